package replay

import (
	"math/rand/v2"
	"sync"
	"time"
)

// eventOverhead approximates what an event costs besides its frame (the
// Event struct and its slot in the ring), so that MaxBytes bounds memory.
const eventOverhead = 64

// Memory is the in-memory event log: a ring buffer per channel, bounded by
// count, age and bytes. It is safe for concurrent use.
type Memory struct {
	mu       sync.RWMutex
	channels map[string]*ring
	now      func() time.Time
	// epoch is drawn when the log is made, and is the epoch of the position
	// of a channel without events (seq 0): a client that saw a channel
	// empty in another log (before a restart) may have missed events
	// published there before it was lost, and is told its replay was
	// truncated. (With the zero position, an empty channel of the new log
	// looked like the one the client saw, and those events were missed
	// silently.)
	epoch uint32
}

// NewMemory returns an empty in-memory log.
func NewMemory() *Memory {
	return &Memory{channels: make(map[string]*ring), now: time.Now, epoch: newEpoch()}
}

// ring is one channel's history: events[start:] are retained, oldest first.
type ring struct {
	mu     sync.Mutex
	head   Position
	events []*Event
	start  int
	bytes  int64
	maxAge time.Duration
	// watched is when a sweep last found streams subscribed to the
	// channel (Unix ms): it is kept as long as after its last event.
	watched int64
	dead    bool // dropped by Sweep; see lockedRing
}

func (r *ring) Len() int        { return len(r.events) - r.start }
func (r *ring) At(i int) *Event { return r.events[r.start+i] }
func (r *ring) oldest() *Event  { return r.events[r.start] }
func (r *ring) empty() bool     { return r.Len() == 0 }

// Append adds an event with the given frame to channel's history and calls
// then with it before any later Append on the same channel can run, so that
// delivering in then keeps the channel's order. then may be nil.
func (m *Memory) Append(channel string, frame []byte, lim Limits, then func(*Event)) *Event {
	r := m.lockedRing(channel)
	defer r.mu.Unlock()
	ev := r.append(frame, lim, m.now())
	if then != nil {
		then(ev)
	}
	return ev
}

// lockedRing returns the channel's ring, locked. A ring that Sweep dropped
// between the lookup and the lock is dead: look again, so that the event is
// not appended to a ring nothing points to.
func (m *Memory) lockedRing(channel string) *ring {
	for {
		r := m.ringFor(channel)
		r.mu.Lock()
		if !r.dead {
			return r
		}
		r.mu.Unlock()
	}
}

func (m *Memory) ringFor(channel string) *ring {
	m.mu.RLock()
	r := m.channels[channel]
	m.mu.RUnlock()
	if r != nil {
		return r
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if r = m.channels[channel]; r == nil {
		r = &ring{}
		m.channels[channel] = r
	}
	return r
}

func (r *ring) append(frame []byte, lim Limits, now time.Time) *Event {
	if r.head.Epoch == 0 {
		r.head.Epoch = newEpoch()
	}
	ms := now.UnixMilli()
	if ms < r.head.Time {
		ms = r.head.Time // the clock went back; keep time monotonic per channel
	}
	r.head = Position{Epoch: r.head.Epoch, Seq: r.head.Seq + 1, Time: ms}
	ev := &Event{Pos: r.head, Frame: frame}
	r.events = append(r.events, ev)
	r.bytes += eventSize(ev)
	r.maxAge = lim.MaxAge
	r.trim(lim, now)
	return ev
}

// trim drops the oldest events beyond the limits, and compacts the ring when
// more than half of it is dropped slots. The newest event always stays,
// even one that alone is over MaxBytes (a frame of many short lines grows
// well past its data): an accepted event is never lost from the history
// that streams catch up from.
func (r *ring) trim(lim Limits, now time.Time) {
	for r.Len() > 1 && ((lim.Count > 0 && r.Len() > lim.Count) || (lim.MaxBytes > 0 && r.bytes > lim.MaxBytes)) {
		r.dropOldest()
	}
	r.expire(now)
	if r.start > 0 && r.start >= len(r.events)/2 {
		n := copy(r.events, r.events[r.start:])
		clear(r.events[n:])
		r.events = r.events[:n]
		r.start = 0
	}
}

func (r *ring) expire(now time.Time) {
	if r.maxAge <= 0 {
		return
	}
	cutoff := now.Add(-r.maxAge).UnixMilli()
	for !r.empty() && r.oldest().Pos.Time < cutoff {
		r.dropOldest()
	}
}

func (r *ring) dropOldest() {
	r.bytes -= eventSize(r.oldest())
	r.events[r.start] = nil
	r.start++
}

func eventSize(ev *Event) int64 { return int64(len(ev.Frame)) + eventOverhead }

// Read returns the events of channel after position after, at most limit,
// following the replay rules of Select. With after nil it returns only the
// channel's head: where a stream that starts live is.
func (m *Memory) Read(channel string, after *Position, limit int) Page {
	m.mu.RLock()
	r := m.channels[channel]
	m.mu.RUnlock()
	if r == nil {
		return m.page(emptyWindow{}, Position{Epoch: m.epoch}, after, limit)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expire(m.now())
	return m.page(r, r.head, after, limit)
}

// page answers a Read of a channel whose history is w, at head.
func (m *Memory) page(w Window, head Position, after *Position, limit int) Page {
	switch {
	case after == nil:
		return Page{Head: head}
	case m.lost(*after):
		return newest(w, limit, Page{Head: head})
	}
	return Select(w, head, *after, limit)
}

// lost reports whether after is a channel seen empty in another log: its
// history, and whatever was published to it after, is not this log's.
func (m *Memory) lost(after Position) bool {
	return after.IsZero() && after.Epoch != 0 && after.Epoch != m.epoch
}

// Sweep frees what has expired: old events of every channel, and channels
// that have kept no event for longer than their max age. The hub calls it
// periodically so that quiet channels do not hold memory. A channel that
// watched reports streams are subscribed to is never forgotten, however
// quiet: its next event must follow their position, in the same epoch.
// watched may be nil (no channel is watched); it is called with the
// channel's lock held and must not call back into the log.
func (m *Memory) Sweep(watched func(channel string) bool) {
	if watched == nil {
		m.SweepWatched(nil)
		return
	}
	m.SweepWatched(func(channel string) (bool, time.Time) { return watched(channel), time.Time{} })
}

// SweepWatched is Sweep with, for a channel no stream watches now, when
// the last one left it (zero if unknown): the channel is kept 2*max age
// from then as from a sweep that saw it watched, so that a stream that came
// and went between two sweeps counts too (its client holds ids naming the
// channel's head).
func (m *Memory) SweepWatched(watched func(channel string) (now bool, left time.Time)) {
	now := m.now()
	// one channel at a time, the log's lock taken only to list them and to
	// drop the dead: held for the whole pass (35 ms at 100k channels), it
	// stopped every publish and every stream's start meanwhile
	for _, c := range m.listed() {
		if c.r.sweep(c.name, now, watched) {
			m.drop(c.name, c.r)
		}
	}
}

// namedRing is a channel's ring with its name.
type namedRing struct {
	name string
	r    *ring
}

// listed returns the log's channels as they are now.
func (m *Memory) listed() []namedRing {
	m.mu.RLock()
	defer m.mu.RUnlock()
	list := make([]namedRing, 0, len(m.channels))
	for name, r := range m.channels {
		list = append(list, namedRing{name, r})
	}
	return list
}

// sweep frees the ring's expired events and reports whether the channel is
// to be forgotten: empty, unwatched and quiet for long enough. It is then
// dead: an append that finds it looks the channel up again (lockedRing).
func (r *ring) sweep(name string, now time.Time, watched func(string) (bool, time.Time)) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead {
		return false
	}
	r.expire(now)
	r.trim(Limits{Count: r.Len()}, now) // compacts
	var watchedNow bool
	var left time.Time
	if watched != nil {
		watchedNow, left = watched(name)
	}
	switch {
	case watchedNow:
		r.watched = now.UnixMilli()
		return false
	case !left.IsZero():
		r.watched = max(r.watched, left.UnixMilli())
	}
	r.dead = r.empty() && r.forgettable(now)
	return r.dead
}

// drop forgets a dead channel's ring, unless the channel has another by now.
func (m *Memory) drop(name string, r *ring) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.channels[name] == r {
		delete(m.channels, name)
	}
}

// forgettable reports whether an empty channel's head can be dropped. It is
// kept for one more max age after its last event, or after a sweep last saw
// it watched, so that streams and cursors of a quiet channel keep their
// epoch (a new epoch would tell them their history was lost).
func (r *ring) forgettable(now time.Time) bool {
	keep := 2 * r.maxAge
	if keep <= 0 {
		keep = 48 * time.Hour
	}
	return now.UnixMilli()-max(r.head.Time, r.watched) > keep.Milliseconds()
}

// Holds reports whether the log keeps channel's history (or head).
func (m *Memory) Holds(channel string) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, ok := m.channels[channel]
	return ok
}

// Stats returns how many channels and events the log holds and their bytes.
func (m *Memory) Stats() (channels, events int, bytes int64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, r := range m.channels {
		r.mu.Lock()
		events += r.Len()
		bytes += r.bytes
		r.mu.Unlock()
	}
	return len(m.channels), events, bytes
}

type emptyWindow struct{}

func (emptyWindow) Len() int      { return 0 }
func (emptyWindow) At(int) *Event { return nil }

// newEpoch returns a random non-zero epoch; zero is the position before a
// channel's first event.
func newEpoch() uint32 {
	for {
		if e := rand.Uint32(); e != 0 {
			return e
		}
	}
}
