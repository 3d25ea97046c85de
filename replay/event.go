// Package replay holds the per-channel event log behind Last-Event-ID: the
// positions that identify events, the cursors that clients send back, the
// rules that decide what a reconnecting client is replayed, and an in-memory
// log (a ring buffer per channel). It does not import Caddy.
package replay

import "time"

// Position is where an event sits in its channel. Epoch identifies one
// unbroken history of the channel (it changes when the history is lost, e.g.
// after a restart of the embedded hub or a Redis flush), Seq counts up by one
// per event, and Time is the hub's clock at publish in Unix milliseconds.
//
// A Position at seq 0 means "before the first event of the channel": a
// client that saw a channel while it was empty holds it, and is replayed
// from the channel's first event whatever epoch that event has. Its epoch
// names the history that was empty, so that a hub that lost it can tell the
// client: the in-memory log's own epoch (see Memory; a restart replaces
// it), or in Redis the channel's epoch started before its first event
// (pubsub's redis_open.go). It is zero where neither was known.
type Position struct {
	Epoch uint32
	Seq   uint64
	Time  int64
}

// IsZero reports whether p is the position before a channel's first event.
func (p Position) IsZero() bool { return p.Seq == 0 }

// Follows reports whether an event at q comes directly after p, so that a
// stream at p can write it without a gap.
func (p Position) Follows(q Position) bool {
	if p.IsZero() {
		return q.Seq == 1
	}
	return q.Epoch == p.Epoch && q.Seq == p.Seq+1
}

// Covers reports whether a stream at p has already written the event at q
// (same history, not newer).
func (p Position) Covers(q Position) bool {
	return q.Epoch == p.Epoch && q.Seq <= p.Seq && !p.IsZero()
}

// Contradicts reports whether an event at q cannot belong to the history a
// stream at p has written: same epoch, not after p, yet newer than p (or at
// p's seq with another time). It happens when a failover lost events and
// their seqs were given to new ones.
func (p Position) Contradicts(q Position) bool {
	if p.IsZero() || q.Epoch != p.Epoch || q.Seq > p.Seq {
		return false
	}
	return q.Time > p.Time || (q.Seq == p.Seq && q.Time != p.Time)
}

// Holds reports whether a stream at p has written the event at q in the
// history it follows: p covers q and q does not contradict it. An event it
// holds is a duplicate.
func (p Position) Holds(q Position) bool { return p.Covers(q) && !p.Contradicts(q) }

// Event is one event as stored and delivered: its position and its encoded
// "event:"/"data:" lines. Frame is shared by every subscriber and by the
// history, so it must never be modified.
type Event struct {
	Pos   Position
	Frame []byte
	// Local marks an event that reached only this instance, under an epoch
	// of its own, because the shared backend was unreachable (fallback
	// local). Streams write it without looking for a gap before it.
	Local bool
}

// Limits bound a channel's history. They are given with every append, as
// the publisher's configuration decides how much history it keeps.
type Limits struct {
	// Count is the most events kept per channel.
	Count int
	// MaxAge is how long an event is kept.
	MaxAge time.Duration
	// MaxBytes bounds the total size of the frames kept per channel.
	MaxBytes int64
}

// Page is the answer to a history read.
type Page struct {
	// Events are the events to replay, oldest first.
	Events []*Event
	// Head is the channel's newest position at the time of the read (the
	// zero Position if the channel has no history).
	Head Position
	// Truncated is set when the events do not follow on from the position
	// read after: too many of them, or the history does not reach back that
	// far, or it was rewritten. Events are then the newest retained ones.
	Truncated bool
}

// Last returns the position a stream is at after writing the page: its
// last event, or Head if it has none.
func (p Page) Last() Position {
	if n := len(p.Events); n > 0 {
		return p.Events[n-1].Pos
	}
	return p.Head
}
