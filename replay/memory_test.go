package replay

import (
	"bytes"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock is injected into Memory.now so that age limits are tested
// without waiting.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

func newTestMemory() (*Memory, *fakeClock) {
	clock := &fakeClock{t: time.UnixMilli(1_700_000_000_000)}
	m := NewMemory()
	m.now = clock.Now
	return m, clock
}

var noLimits = Limits{}

// frameOfSize returns a frame whose stored size (with the per-event
// overhead) is exactly size.
func frameOfSize(size int64) []byte {
	return bytes.Repeat([]byte("x"), int(size-eventOverhead))
}

func TestMemoryAppendAssignsContiguousSeqsInOneEpoch(t *testing.T) {
	m, _ := newTestMemory()
	var epoch uint32
	for i := uint64(1); i <= 100; i++ {
		frame := []byte(fmt.Sprintf("data: %d\n", i))
		ev := m.Append("a", frame, noLimits, nil)
		if ev.Pos.Seq != i {
			t.Fatalf("append %d got seq %d", i, ev.Pos.Seq)
		}
		if i == 1 {
			epoch = ev.Pos.Epoch
		}
		if ev.Pos.Epoch == 0 || ev.Pos.Epoch != epoch {
			t.Fatalf("append %d got epoch %d, want the channel's non-zero epoch %d", i, ev.Pos.Epoch, epoch)
		}
		if &ev.Frame[0] != &frame[0] || len(ev.Frame) != len(frame) {
			t.Fatalf("the event does not hold the frame it was given")
		}
	}
	// Another channel counts on its own.
	if ev := m.Append("b", []byte("x"), noLimits, nil); ev.Pos.Seq != 1 || ev.Pos.Epoch == 0 {
		t.Errorf("first event of another channel at %+v, want seq 1 in a non-zero epoch", ev.Pos)
	}
}

// Epochs tell apart histories (SPEC S1): a constant epoch would make a
// restarted hub's history look like the old one.
func TestMemoryEpochsAreRandom(t *testing.T) {
	m, _ := newTestMemory()
	seen := map[uint32]bool{}
	for i := range 50 {
		seen[m.Append(fmt.Sprint("ch", i), nil, noLimits, nil).Pos.Epoch] = true
	}
	if len(seen) < 45 {
		t.Errorf("50 channels got only %d distinct epochs", len(seen))
	}
}

func TestMemoryTimeIsTheClockAndMonotonic(t *testing.T) {
	m, clock := newTestMemory()
	start := clock.Now()
	if got := m.Append("a", nil, noLimits, nil).Pos.Time; got != start.UnixMilli() {
		t.Fatalf("time %d, want the clock's %d", got, start.UnixMilli())
	}
	clock.Set(start.Add(-5 * time.Second)) // the clock goes back
	if got := m.Append("a", nil, noLimits, nil).Pos.Time; got != start.UnixMilli() {
		t.Errorf("time went back to %d, want it held at %d", got, start.UnixMilli())
	}
	clock.Set(start.Add(time.Millisecond))
	if got := m.Append("a", nil, noLimits, nil).Pos.Time; got != start.UnixMilli()+1 {
		t.Errorf("time %d, want %d", got, start.UnixMilli()+1)
	}
}

func TestMemoryTrimsByCount(t *testing.T) {
	m, _ := newTestMemory()
	lim := Limits{Count: 3}
	var evs []*Event
	for range 10 {
		evs = append(evs, m.Append("a", []byte("x"), lim, nil))
	}
	page := m.Read("a", &Position{}, 100)
	if got := seqsOf(page.Events); !equalSeqs(got, seqRange(8, 10)) || !page.Truncated {
		t.Errorf("replay from the start = %v truncated %v, want [8 9 10] truncated (seq 1 evicted)", got, page.Truncated)
	}
	if page := m.Read("a", &evs[6].Pos, 100); !equalSeqs(seqsOf(page.Events), seqRange(8, 10)) || page.Truncated {
		t.Errorf("replay after 7 = %v truncated %v, want [8 9 10] not truncated", seqsOf(page.Events), page.Truncated)
	}
	if page := m.Read("a", &evs[5].Pos, 100); !page.Truncated {
		t.Errorf("replay after 6 = %v not truncated, but 7 was evicted", seqsOf(page.Events))
	}
	if _, events, _ := m.Stats(); events != 3 {
		t.Errorf("Stats events = %d, want 3", events)
	}
}

func TestMemoryTrimsByBytes(t *testing.T) {
	m, _ := newTestMemory()
	const size = 100
	lim := Limits{MaxBytes: 3*size + size/2}
	for range 10 {
		m.Append("a", frameOfSize(size), lim, nil)
	}
	page := m.Read("a", &Position{}, 100)
	if got := seqsOf(page.Events); !equalSeqs(got, seqRange(8, 10)) {
		t.Errorf("retained %v, want [8 9 10]", got)
	}
	if _, events, bytes := m.Stats(); events != 3 || bytes != 3*size {
		t.Errorf("Stats = %d events, %d bytes; want 3, %d", events, bytes, 3*size)
	}
}

// An event bigger than the byte cap cannot be kept, but it still happened:
// the head moves on, so that streams see the gap.
// An event larger than MaxBytes on its own (a frame of many short lines
// grows far past its data) is kept, alone: an accepted event is never lost
// from the history, and the older ones go as the cap says.
func TestMemoryEventLargerThanMaxBytesIsKeptAlone(t *testing.T) {
	m, _ := newTestMemory()
	lim := Limits{MaxBytes: 150}
	first := m.Append("a", frameOfSize(100), lim, nil)
	big := m.Append("a", frameOfSize(1000), lim, nil)
	if big.Pos.Seq != 2 {
		t.Fatalf("big event at seq %d, want 2", big.Pos.Seq)
	}
	if head := m.Read("a", nil, 10).Head; head != big.Pos {
		t.Errorf("head %+v, want the big event's %+v", head, big.Pos)
	}
	if _, events, _ := m.Stats(); events != 1 {
		t.Errorf("kept %d events, want the big one alone", events)
	}
	if page := m.Read("a", &first.Pos, 10); page.Truncated || len(page.Events) != 1 || page.Events[0].Pos != big.Pos {
		t.Errorf("a stream at seq 1 reads %+v, want the big event", page)
	}
	next := m.Append("a", frameOfSize(80), lim, nil)
	if page := m.Read("a", &Position{}, 10); len(page.Events) != 1 || page.Events[0].Pos != next.Pos {
		t.Errorf("after a small event the history holds %+v, want it alone (the big one is over the cap)", page.Events)
	}
}

func TestMemoryTrimsByMaxAge(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: 1500 * time.Millisecond}
	m.Append("a", nil, lim, nil) // t0
	clock.Advance(time.Second)
	m.Append("a", nil, lim, nil) // t0+1s
	clock.Advance(time.Second)
	m.Append("a", nil, lim, nil) // t0+2s: seq 1 is now 2s old

	if got := seqsOf(m.Read("a", &Position{}, 10).Events); !equalSeqs(got, seqRange(2, 3)) {
		t.Errorf("at t0+2s retained %v, want [2 3]", got)
	}
	// A read expires too, without waiting for the next append or sweep.
	clock.Advance(time.Second) // t0+3s: seq 2 is 2s old
	if got := seqsOf(m.Read("a", &Position{}, 10).Events); !equalSeqs(got, seqRange(3, 3)) {
		t.Errorf("at t0+3s retained %v, want [3]", got)
	}
	clock.Advance(time.Hour)
	page := m.Read("a", &Position{}, 10)
	if len(page.Events) != 0 || page.Head.Seq != 3 {
		t.Errorf("after an hour: events %v head %+v; want none, head still at seq 3", seqsOf(page.Events), page.Head)
	}
}

// An event exactly MaxAge old is still kept; one millisecond more and it is
// gone.
func TestMemoryMaxAgeBoundary(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: time.Second}
	m.Append("a", nil, lim, nil)
	clock.Advance(time.Second)
	if n := len(m.Read("a", &Position{}, 10).Events); n != 1 {
		t.Errorf("event exactly MaxAge old: %d retained, want 1", n)
	}
	clock.Advance(time.Millisecond)
	if n := len(m.Read("a", &Position{}, 10).Events); n != 0 {
		t.Errorf("event MaxAge+1ms old: %d retained, want 0", n)
	}
}

func TestMemoryReadWithoutPositionReturnsHeadOnly(t *testing.T) {
	m, _ := newTestMemory()
	var last *Event
	for range 5 {
		last = m.Append("a", []byte("x"), noLimits, nil)
	}
	page := m.Read("a", nil, 100)
	if page.Head != last.Pos || len(page.Events) != 0 || page.Truncated {
		t.Errorf("Read(nil) = %+v, want only head %+v", page, last.Pos)
	}
}

func TestMemoryReadFollowsOn(t *testing.T) {
	m, _ := newTestMemory()
	var evs []*Event
	for range 10 {
		evs = append(evs, m.Append("a", []byte("x"), noLimits, nil))
	}
	page := m.Read("a", &evs[3].Pos, 100)
	if got := seqsOf(page.Events); !equalSeqs(got, seqRange(5, 10)) || page.Truncated {
		t.Errorf("after seq 4: %v truncated %v, want [5..10]", got, page.Truncated)
	}
	for i, ev := range page.Events {
		if ev != evs[4+i] {
			t.Errorf("event %d is not the appended event", i)
		}
	}
	if page := m.Read("a", &evs[9].Pos, 100); len(page.Events) != 0 || page.Truncated || page.Head != evs[9].Pos {
		t.Errorf("at the head: %+v, want nothing", page)
	}
	if page := m.Read("a", &evs[0].Pos, 4); !page.Truncated || !equalSeqs(seqsOf(page.Events), seqRange(7, 10)) {
		t.Errorf("9 events after seq 1 with limit 4: %v truncated %v, want [7..10] truncated", seqsOf(page.Events), page.Truncated)
	}
}

func TestMemoryReadUnknownChannel(t *testing.T) {
	m, _ := newTestMemory()
	page := m.Read("nope", nil, 10)
	if !page.Head.IsZero() || page.Head.Epoch == 0 || page.Events != nil || page.Truncated {
		t.Errorf("Read(nil) of an unknown channel = %+v, want nothing, at seq 0 in the log's epoch", page)
	}
	if again := m.Read("nope", &page.Head, 10); len(again.Events) != 0 || again.Truncated {
		t.Errorf("Read(its own empty head) of an unknown channel = %+v, want nothing, not truncated", again)
	}
	// A stream that saw the channel empty is still up to date.
	if page := m.Read("nope", &Position{}, 10); len(page.Events) != 0 || page.Truncated {
		t.Errorf("Read(zero) of an unknown channel = %+v, want nothing, not truncated", page)
	}
	// A cursor of a history this log does not have is told it lost it.
	if page := m.Read("nope", &Position{Epoch: 3, Seq: 4, Time: 5}, 10); !page.Truncated {
		t.Errorf("Read of an unknown channel at a position = %+v, want truncated", page)
	}
	if channels, _, _ := m.Stats(); channels != 0 {
		t.Errorf("reading created %d channels", channels)
	}
}

// Pages hold their own slice of events: later appends and compactions of
// the ring must not change a page a stream is still writing.
func TestMemoryPagesAreSnapshots(t *testing.T) {
	m, _ := newTestMemory()
	lim := Limits{Count: 4}
	for range 4 {
		m.Append("a", []byte("old"), lim, nil)
	}
	page := m.Read("a", &Position{}, 10)
	want := seqsOf(page.Events)
	for range 100 {
		m.Append("a", []byte("new"), lim, nil)
	}
	if got := seqsOf(page.Events); !equalSeqs(got, want) {
		t.Errorf("page changed from %v to %v", want, got)
	}
	for _, ev := range page.Events {
		if string(ev.Frame) != "old" {
			t.Errorf("event %d frame changed to %q", ev.Pos.Seq, ev.Frame)
		}
	}
}

// A channel with a small Count but many appends must not keep a growing
// slice of dropped slots.
func TestMemoryCompactsTheRing(t *testing.T) {
	m, _ := newTestMemory()
	lim := Limits{Count: 10}
	for range 10_000 {
		m.Append("a", []byte("x"), lim, nil)
	}
	r := m.channels["a"]
	if r.Len() != 10 {
		t.Fatalf("retained %d, want 10", r.Len())
	}
	if len(r.events) > 2*lim.Count+1 || cap(r.events) > 8*lim.Count {
		t.Errorf("ring slice len %d cap %d for %d retained events: not compacted", len(r.events), cap(r.events), r.Len())
	}
	for i := 0; i < r.start; i++ {
		if r.events[i] != nil {
			t.Fatalf("dropped slot %d still references an event", i)
		}
	}
}

func TestMemorySweepDropsExpiredEvents(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: time.Minute}
	m.Append("a", []byte("xx"), lim, nil)
	clock.Advance(30 * time.Second)
	m.Append("a", []byte("yy"), lim, nil)
	clock.Advance(31 * time.Second)

	m.Sweep(nil)
	if channels, events, bytes := m.Stats(); channels != 1 || events != 1 || bytes != 2+eventOverhead {
		t.Errorf("after sweep: %d channels, %d events, %d bytes; want 1, 1, %d", channels, events, bytes, 2+eventOverhead)
	}
	if r := m.channels["a"]; r.start != 0 || len(r.events) != 1 {
		t.Errorf("sweep left the ring uncompacted: start %d len %d", r.start, len(r.events))
	}
}

// A quiet channel keeps its head (and so its epoch) for 2*maxAge after its
// last event, so that its streams' cursors stay valid; then it is freed.
func TestMemorySweepForgetsEmptyChannelsAfterTwiceMaxAge(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: time.Minute}
	last := m.Append("quiet", nil, lim, nil)
	m.Append("busy", nil, Limits{}, nil)

	clock.Advance(90 * time.Second) // the event expired, the channel is empty
	m.Sweep(nil)
	if channels, events, _ := m.Stats(); channels != 2 || events != 1 {
		t.Fatalf("after 1.5 max age: %d channels, %d events; want 2, 1", channels, events)
	}
	if head := m.Read("quiet", nil, 10).Head; head != last.Pos {
		t.Errorf("head of the quiet channel %+v, want %+v kept", head, last.Pos)
	}

	clock.Advance(30 * time.Second) // exactly 2*maxAge: still kept
	m.Sweep(nil)
	if channels, _, _ := m.Stats(); channels != 2 {
		t.Fatalf("at exactly 2 max age: %d channels, want 2", channels)
	}

	clock.Advance(time.Millisecond)
	m.Sweep(nil)
	if channels, _, _ := m.Stats(); channels != 1 {
		t.Fatalf("after 2 max age: %d channels, want only the busy one", channels)
	}
	if page := m.Read("quiet", &last.Pos, 10); !page.Truncated {
		t.Errorf("a cursor into the forgotten history was not told it is truncated: %+v", page)
	}
	if ev := m.Append("quiet", nil, lim, nil); ev.Pos.Seq != 1 {
		t.Errorf("the forgotten channel restarted at seq %d, want a new history from 1", ev.Pos.Seq)
	}
}

// A quiet channel that streams are subscribed to keeps its head however
// long it stays empty: its next event must follow their position, in the
// same epoch, or every open stream on it is ended as if it had missed
// events. Once no longer watched it is kept 2*maxAge more, then freed.
func TestMemorySweepKeepsWatchedChannels(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: time.Minute}
	last := m.Append("watched", nil, lim, nil)
	m.Append("idle", nil, lim, nil)
	isWatched := true
	watched := func(name string) bool { return isWatched && name == "watched" }

	clock.Advance(time.Hour) // both empty for far longer than 2*maxAge
	m.Sweep(watched)
	if channels, events, _ := m.Stats(); channels != 1 || events != 0 {
		t.Fatalf("after an hour: %d channels, %d events; want only the watched one, empty", channels, events)
	}
	if head := m.Read("watched", nil, 10).Head; head != last.Pos {
		t.Fatalf("head of the watched channel %+v, want %+v kept", head, last.Pos)
	}
	if ev := m.Append("watched", nil, lim, nil); !last.Pos.Follows(ev.Pos) {
		t.Fatalf("the watched channel's next event %+v does not follow %+v: a new history", ev.Pos, last.Pos)
	}

	isWatched = false // its streams left
	clock.Advance(time.Hour)
	m.Sweep(watched) // the event expired; last seen watched an hour ago
	if channels, _, _ := m.Stats(); channels != 0 {
		t.Fatalf("%d channels after the last stream left, want 0", channels)
	}

	// the grace counts from the last sweep that saw it watched
	m.Append("c", nil, lim, nil)
	clock.Advance(time.Hour)
	m.Sweep(func(string) bool { return true })
	clock.Advance(2 * time.Minute)
	m.Sweep(nil)
	if channels, _, _ := m.Stats(); channels != 1 {
		t.Fatalf("%d channels 2*maxAge after a sweep saw it watched, want 1 kept", channels)
	}
	clock.Advance(time.Millisecond)
	m.Sweep(nil)
	if channels, _, _ := m.Stats(); channels != 0 {
		t.Fatalf("%d channels after the grace, want 0", channels)
	}
}

func TestMemorySweepKeepsChannelsWithEvents(t *testing.T) {
	m, clock := newTestMemory()
	m.Append("forever", nil, Limits{}, nil) // no max age
	clock.Advance(1000 * time.Hour)
	m.Sweep(nil)
	if channels, events, _ := m.Stats(); channels != 1 || events != 1 {
		t.Errorf("after sweep: %d channels, %d events; want 1, 1", channels, events)
	}
}

func TestMemoryStats(t *testing.T) {
	m, _ := newTestMemory()
	if c, e, b := m.Stats(); c != 0 || e != 0 || b != 0 {
		t.Fatalf("empty log stats %d %d %d", c, e, b)
	}
	m.Append("a", make([]byte, 10), noLimits, nil)
	m.Append("a", make([]byte, 20), noLimits, nil)
	m.Append("b", make([]byte, 30), noLimits, nil)
	c, e, b := m.Stats()
	if c != 2 || e != 3 || b != 60+3*eventOverhead {
		t.Errorf("Stats = %d channels, %d events, %d bytes; want 2, 3, %d", c, e, b, 60+3*eventOverhead)
	}
}

// The hub delivers in Append's callback; it must run under the channel's
// lock, in seq order. The per-channel slices are appended to without a lock
// of their own, so the race detector also fails this test if two callbacks
// of one channel ever run at once.
func TestMemoryThenRunsInOrderPerChannel(t *testing.T) {
	m, _ := newTestMemory()
	const goroutines, each = 8, 500
	channels := []string{"a", "b"}
	seen := map[string]*[]uint64{"a": new([]uint64), "b": new([]uint64)}

	var wg sync.WaitGroup
	var mismatches, overlaps atomic.Int32
	inside := map[string]*atomic.Int32{"a": new(atomic.Int32), "b": new(atomic.Int32)}
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				ch := channels[(g+i)%len(channels)]
				var inThen *Event
				ev := m.Append(ch, nil, Limits{Count: 100}, func(ev *Event) {
					inThen = ev
					if inside[ch].Add(1) != 1 {
						overlaps.Add(1)
					}
					runtime.Gosched() // widen the window for another callback to overlap
					*seen[ch] = append(*seen[ch], ev.Pos.Seq)
					inside[ch].Add(-1)
				})
				if ev != inThen {
					mismatches.Add(1)
				}
			}
		}()
	}
	wg.Wait()

	if n := mismatches.Load(); n != 0 {
		t.Errorf("%d appends returned another event than the one given to then", n)
	}
	if n := overlaps.Load(); n != 0 {
		t.Errorf("%d callbacks ran while another of the same channel was running", n)
	}
	for _, ch := range channels {
		got := *seen[ch]
		if want := seqRange(1, goroutines*each/2); !equalSeqs(got, want) {
			t.Errorf("channel %s: callbacks saw %d seqs, not 1..%d in order (first out of order at %d)",
				ch, len(got), len(want), firstMismatch(got, want))
		}
	}
}

func firstMismatch(a, b []uint64) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// Readers racing appenders always see a consistent page: a contiguous tail
// ending at the head they were given.
func TestMemoryConcurrentReadsSeeConsistentPages(t *testing.T) {
	m, _ := newTestMemory()
	lim := Limits{Count: 50}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
					m.Append("a", []byte("x"), lim, nil)
				}
			}
		}()
	}
	for range 2000 {
		page := m.Read("a", &Position{}, 20)
		got := seqsOf(page.Events)
		if len(got) > 0 && !equalSeqs(got, seqRange(page.Head.Seq-uint64(len(got))+1, page.Head.Seq)) {
			t.Errorf("page %v does not end at head %d", got, page.Head.Seq)
			break
		}
	}
	close(stop)
	wg.Wait()
}

// An Append that took the channel's ring just before Sweep forgot it must
// not land in the forgotten ring: its event would be delivered live but be
// missing from the history, and the channel's next event would start a new
// epoch, so the stream that received it is told its history was lost.
//
// The clock is read between looking up the ring and locking it, so the test
// holds the append there while Sweep runs.
func TestMemoryAppendRacingSweepIsNotLost(t *testing.T) {
	m, clock := newTestMemory()
	lim := Limits{MaxAge: time.Second}
	m.Append("c", []byte("x"), lim, nil)
	clock.Advance(time.Hour) // expired and forgettable at the next sweep

	entered, release := make(chan struct{}), make(chan struct{})
	var trap atomic.Bool
	trap.Store(true)
	m.now = func() time.Time {
		if trap.CompareAndSwap(true, false) {
			close(entered)
			<-release
		}
		return clock.Now()
	}
	appended := make(chan *Event, 1)
	go func() { appended <- m.Append("c", []byte("y"), lim, nil) }()
	waitClosed(t, entered, "the append to read the clock")

	swept := make(chan struct{})
	go func() { m.Sweep(nil); close(swept) }()
	select {
	case <-swept:
	case <-time.After(200 * time.Millisecond):
		// Sweep waits for the append: the clock is read under the lock.
	}
	close(release)
	var ev *Event
	select {
	case ev = <-appended:
	case <-time.After(5 * time.Second):
		t.Fatal("append did not return")
	}
	waitClosed(t, swept, "the sweep to return")

	if head := m.Read("c", nil, 10).Head; head != ev.Pos {
		t.Errorf("head after the racing append is %+v, want the appended event's %+v", head, ev.Pos)
	}
	if next := m.Append("c", nil, lim, nil); !ev.Pos.Follows(next.Pos) {
		t.Errorf("the next event %+v does not follow the racing one %+v", next.Pos, ev.Pos)
	}
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// A sweep holds one channel at a time: a publish to another channel does
// not wait for its whole pass. It held the log's lock throughout (35 ms at
// 100k channels, once a minute), and every publish and every stream's start
// waited for it.
func TestMemorySweepHoldsOneChannelAtATime(t *testing.T) {
	m := NewMemory()
	lim := Limits{MaxAge: time.Hour}
	m.Append("a", []byte("x"), lim, nil)
	inSweep, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	var once sync.Once
	go m.SweepWatched(func(string) (bool, time.Time) {
		once.Do(func() { close(inSweep); <-release })
		return true, time.Time{}
	})
	waitClosed(t, inSweep, "the sweep to reach channel a")
	published := make(chan struct{})
	go func() { m.Append("b", []byte("y"), lim, nil); close(published) }()
	waitClosed(t, published, "a publish to b while the sweep holds a")
}

// A client that saw a channel empty in another log (before a restart) may
// have missed events published there before that log was lost: its replay
// is truncated, whether the channel is empty here or not; one that saw it
// empty in this log is replayed its events from seq 1.
func TestMemoryEmptyPositionOfAnotherLogIsTruncated(t *testing.T) {
	old, _ := newTestMemory()
	seen := old.Read("a", nil, 10).Head
	m, _ := newTestMemory()
	if page := m.Read("a", &seen, 10); !page.Truncated || len(page.Events) != 0 {
		t.Errorf("empty here: %+v, want truncated, nothing", page)
	}
	here := m.Read("a", nil, 10).Head
	m.Append("a", []byte("x"), noLimits, nil)
	m.Append("a", []byte("y"), noLimits, nil)
	if page := m.Read("a", &seen, 10); !page.Truncated || !equalSeqs(seqsOf(page.Events), seqRange(1, 2)) {
		t.Errorf("with events here: %v truncated %v, want [1 2] truncated", seqsOf(page.Events), page.Truncated)
	}
	if page := m.Read("a", &here, 10); page.Truncated || !equalSeqs(seqsOf(page.Events), seqRange(1, 2)) {
		t.Errorf("seen empty in this log: %v truncated %v, want [1 2]", seqsOf(page.Events), page.Truncated)
	}
	if page := m.Read("a", &Position{}, 10); page.Truncated || !equalSeqs(seqsOf(page.Events), seqRange(1, 2)) {
		t.Errorf("the zero position: %v truncated %v, want [1 2]", seqsOf(page.Events), page.Truncated)
	}
}
