package pubsub

import (
	"context"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// libraryLoads runs one load of the library per node at a time. On a fresh
// or flushed Redis every call of a burst of new connections finds the
// library missing; each FUNCTION LOAD compiles the library and blocks Redis
// while it does (about 0.1 ms), and hundreds of them in a row held up the
// very calls that waited for them. A call that finds a load of its node
// under way waits for that load instead of starting another.
type libraryLoads struct {
	mu       sync.Mutex
	inFlight map[string]*libraryLoad // by node address
}

type libraryLoad struct {
	done    chan struct{}
	err     error
	waiting int // callers waiting for it (under libraryLoads.mu; tests wait for them)
}

// libraryLoadTimeout bounds a load that callers share: it does not end
// with the context of the call that happened to start it.
const libraryLoadTimeout = 10 * time.Second

// do runs load for the node at addr, or waits for the load of that node
// already under way and returns its result.
func (l *libraryLoads) do(ctx context.Context, addr string, load func(context.Context) error) error {
	l.mu.Lock()
	if running, ok := l.inFlight[addr]; ok {
		running.waiting++
		l.mu.Unlock()
		select {
		case <-running.done:
			return running.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	mine := &libraryLoad{done: make(chan struct{})}
	if l.inFlight == nil {
		l.inFlight = make(map[string]*libraryLoad)
	}
	l.inFlight[addr] = mine
	l.mu.Unlock()

	shared, cancel := context.WithTimeout(context.WithoutCancel(ctx), libraryLoadTimeout)
	mine.err = load(shared)
	cancel()
	l.mu.Lock()
	delete(l.inFlight, addr)
	l.mu.Unlock()
	close(mine.done)
	return mine.err
}

// loadOnSlotlessPrimaries loads the library on the primaries that serve no
// slot, as the cluster's nodes list them to node (CLUSTER NODES): a primary
// just added to scale out, importing its first slot. The cluster's slot
// map, which ForEachMaster goes by, does not name them, but a call
// redirected (ASK) to one while its slot migrates runs there, and was
// answered "Function not found" until the migration ended. mapped are the
// addresses of the primaries of the slot map, loaded already. Each is
// loaded through a client of its own, closed after.
func (b *Redis) loadOnSlotlessPrimaries(ctx context.Context, node *redis.Client, mapped map[string]bool) {
	nodes, err := node.ClusterNodes(ctx).Result()
	if err != nil {
		return
	}
	for _, addr := range slotlessPrimaries(nodes) {
		if mapped[addr] || b.closed.Load() {
			continue
		}
		c := redis.NewClient(b.opts.nodeOptions(addr))
		_ = b.loadOn(ctx, c)
		_ = c.Close()
	}
}

// slotlessPrimaries returns the addresses (ip:port) of the primaries that
// serve no slot in a CLUSTER NODES reply ("<id> <ip:port@cport[,hostname]>
// <flags> <primary> <ping> <pong> <epoch> <link> [<slot>...]"), leaving
// out those failed or not yet (or no longer) reachable.
func slotlessPrimaries(nodes string) []string {
	var addrs []string
	for line := range strings.SplitSeq(nodes, "\n") {
		fields := strings.Fields(line)
		if len(fields) < 8 || slices.ContainsFunc(fields[8:], func(f string) bool { return !strings.HasPrefix(f, "[") }) {
			continue // not a node, or one that serves slots ([...]: a slot it imports or migrates)
		}
		flags := "," + fields[2] + ","
		if !strings.Contains(flags, ",master,") || strings.Contains(flags, "fail") ||
			strings.Contains(flags, ",noaddr,") || strings.Contains(flags, ",handshake,") {
			continue
		}
		addr, _, _ := strings.Cut(fields[1], "@")
		addr, _, _ = strings.Cut(addr, ",")
		if host, port, err := net.SplitHostPort(addr); err == nil && host != "" && port != "0" {
			addrs = append(addrs, addr)
		}
	}
	return addrs
}
