package main

// chanAccepted is what the server accepted of one channel's publishes (the
// sequence numbers answered 200), in the form that also crosses to the
// -procs workers: how many, the highest, and those below it that it did not
// accept. Those holes are the failed publishes: few, usually none (a run
// with failed publishes fails anyway), so checking each one against every
// stream costs little.
type chanAccepted struct {
	N     int64   `json:"n"`
	Last  int64   `json:"last"`
	Holes []int64 `json:"holes,omitempty"`
}

// acceptedPerChannel merges what results accepted, per channel. The
// results may be of consecutive plans on the same channels (seqBase).
func acceptedPerChannel(results ...*pubResult) []chanAccepted {
	var sets []seqSet
	for _, r := range results {
		r.mu.Lock()
		if sets == nil {
			sets = make([]seqSet, len(r.accepted))
		}
		for ch := range r.accepted {
			sets[ch].union(&r.accepted[ch])
		}
		r.mu.Unlock()
	}
	acc := make([]chanAccepted, len(sets))
	for ch := range sets {
		acc[ch] = acceptedOf(&sets[ch])
	}
	return acc
}

// acceptedOf describes the set of accepted sequence numbers of a channel.
func acceptedOf(s *seqSet) chanAccepted {
	a := chanAccepted{Last: s.max}
	for seq := int64(1); seq <= s.max; seq++ {
		if s.has(seq) {
			a.N++
		} else {
			a.Holes = append(a.Holes, seq)
		}
	}
	return a
}

// tally compares what clients received with what the server accepted.
// unique counts the accepted events received, lost those not received, and
// extra the distinct events received whose publish failed on the tool's
// side (or was never made): such an event does not make up for a lost one.
type tally struct {
	expected, unique, lost, extra int64
	complete                      int
	clients                       int
}

func countDelivered(clients []*client, acc []chanAccepted) tally {
	t := tally{clients: len(clients)}
	for _, c := range clients {
		full := true
		for s, ch := range c.chans {
			got, extra := c.acceptedSeen(s, &acc[ch])
			t.add(acc[ch].N, got, 1)
			t.extra += extra
			full = full && got >= acc[ch].N
		}
		if full {
			t.complete++
		}
	}
	return t
}

// add counts n streams that received got of the exp accepted events of a
// channel. Counted by acceptedSeen, got never exceeds exp (the events not
// accepted are its extra); a count that does is extra all the same.
func (t *tally) add(exp, got, n int64) {
	t.expected += exp * n
	t.unique += min(got, exp) * n
	t.lost += max(exp-got, 0) * n
	t.extra += max(got-exp, 0) * n
}

// acceptedSeen returns how many of the distinct events c received on slot s
// the server had accepted (got), and how many it had not (extra).
func (c *client) acceptedSeen(s int, a *chanAccepted) (got, extra int64) {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	set := &c.seen[s]
	for _, seq := range a.Holes {
		if set.has(seq) {
			extra++
		}
	}
	extra += set.countAbove(a.Last)
	return c.uniq[s].Load() - extra, extra
}
