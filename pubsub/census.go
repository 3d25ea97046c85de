package pubsub

import (
	"cmp"
	"slices"
	"sync"
)

// Census counts the streams open on this instance: in total, for the
// instance cap, and per principal, for statistics. Channels are counted by
// the hub's subscriptions (see Hub.TopChannels).
type Census struct {
	mu         sync.Mutex
	total      int
	principals map[string]int
}

// Count is a name (a channel or a principal) and its open streams.
type Count struct {
	Name    string
	Streams int
}

// NewCensus returns a census of no stream.
func NewCensus() *Census {
	return &Census{principals: make(map[string]int)}
}

// Enter counts a stream of principal ("" for none) unless limit streams
// are open already (a limit of zero or less means no limit). The check and
// the count are one step, so concurrent streams never exceed the limit.
func (c *Census) Enter(principal string, limit int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if limit > 0 && c.total >= limit {
		return false
	}
	c.total++
	if principal != "" {
		c.principals[principal]++
	}
	return true
}

// Leave uncounts a stream that Enter counted.
func (c *Census) Leave(principal string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total--
	if principal == "" {
		return
	}
	if c.principals[principal]--; c.principals[principal] <= 0 {
		delete(c.principals, principal)
	}
}

// Total returns how many streams are open.
func (c *Census) Total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total
}

// TopPrincipals returns the n principals with the most open streams, most
// first, and how many principals have any.
func (c *Census) TopPrincipals(n int) ([]Count, int) {
	c.mu.Lock()
	all := make([]Count, 0, len(c.principals))
	for name, streams := range c.principals {
		all = append(all, Count{Name: name, Streams: streams})
	}
	c.mu.Unlock()
	return top(all, n), len(all)
}

// top sorts counts by streams (most first, then by name) and keeps n.
func top(all []Count, n int) []Count {
	slices.SortFunc(all, func(a, b Count) int {
		if c := cmp.Compare(b.Streams, a.Streams); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	if len(all) > n {
		all = all[:n]
	}
	return all
}
