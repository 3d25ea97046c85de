package pubsub

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
)

// waitTimeout bounds every wait for an event; deliveries are synchronous
// with the embedded broker, so it is only reached when something is wrong.
const waitTimeout = 5 * time.Second

// received is one delivery to a recorder.
type received struct {
	slot int
	ev   *replay.Event
}

// recorder is a Subscriber that keeps everything it is given. Deliver may be
// called from any publisher's goroutine, so it locks.
type recorder struct {
	mu      sync.Mutex
	got     []received
	changed chan struct{}
	yield   bool // yield in Deliver, to let racing deliveries overtake
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{}, 1)} }

func (r *recorder) Deliver(slot int, ev *replay.Event) {
	if r.yield {
		runtime.Gosched()
	}
	r.mu.Lock()
	r.got = append(r.got, received{slot, ev})
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *recorder) all() []received {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// waitFor waits until the recorder holds at least n events and returns
// them, failing the test at the deadline.
func (r *recorder) waitFor(t *testing.T, n int) []received {
	t.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	for {
		if got := r.all(); len(got) >= n {
			return got
		}
		select {
		case <-r.changed:
		case <-deadline.C:
			t.Fatalf("timed out with %d events, want %d", r.count(), n)
		}
	}
}

// seqsBySlot returns the seqs received on each slot, in delivery order.
func seqsBySlot(got []received) map[int][]uint64 {
	m := map[int][]uint64{}
	for _, g := range got {
		m[g.slot] = append(m[g.slot], g.ev.Pos.Seq)
	}
	return m
}

func newTestHub(t *testing.T) *Hub {
	t.Helper()
	h := NewMemoryHub()
	t.Cleanup(func() { h.Close() })
	return h
}

func publish(t *testing.T, h *Hub, channel, data string) replay.Position {
	t.Helper()
	pos, err := h.Publish(context.Background(), channel, Message{Data: []byte(data)}, replay.Limits{Count: 1000})
	if err != nil {
		t.Fatalf("Publish(%s): %v", channel, err)
	}
	return pos
}

func TestHubDeliversWithTheChannelsSlot(t *testing.T) {
	h := newTestHub(t)
	rec := newRecorder()
	sub := h.Subscribe(rec, []string{"a", "b", "c"})
	defer sub.Close()

	pb := publish(t, h, "b", "to b")
	pc := publish(t, h, "c", "to c")
	pa := publish(t, h, "a", "to a")

	got := rec.waitFor(t, 3)
	want := []struct {
		slot  int
		pos   replay.Position
		frame string
	}{{1, pb, "data: to b\n"}, {2, pc, "data: to c\n"}, {0, pa, "data: to a\n"}}
	if len(got) != len(want) {
		t.Fatalf("got %d events, want %d", len(got), len(want))
	}
	for i, w := range want {
		if got[i].slot != w.slot || got[i].ev.Pos != w.pos || string(got[i].ev.Frame) != w.frame {
			t.Errorf("event %d = slot %d pos %+v frame %q; want slot %d pos %+v frame %q",
				i, got[i].slot, got[i].ev.Pos, got[i].ev.Frame, w.slot, w.pos, w.frame)
		}
	}
}

func TestHubEncodesTheEventOnce(t *testing.T) {
	h := newTestHub(t)
	r1, r2 := newRecorder(), newRecorder()
	defer h.Subscribe(r1, []string{"a"}).Close()
	defer h.Subscribe(r2, []string{"a"}).Close()

	_, err := h.Publish(context.Background(), "a", Message{Type: "update", Data: []byte("x\ny")}, replay.Limits{Count: 10})
	if err != nil {
		t.Fatal(err)
	}
	e1, e2 := r1.waitFor(t, 1)[0].ev, r2.waitFor(t, 1)[0].ev
	if string(e1.Frame) != "event: update\ndata: x\ndata: y\n" {
		t.Errorf("frame %q", e1.Frame)
	}
	// SPEC S3: one frame per hub, the same bytes for every subscriber.
	if e1 != e2 {
		t.Error("subscribers got different events for one publish")
	}
}

func TestHubDeliversOnlySubscribedChannelsWhileSubscribed(t *testing.T) {
	h := newTestHub(t)
	rec := newRecorder()
	publish(t, h, "a", "before")
	sub := h.Subscribe(rec, []string{"a"})
	publish(t, h, "b", "other channel")
	want := publish(t, h, "a", "during")
	sub.Close()
	publish(t, h, "a", "after")

	// A marker subscriber proves the later publishes were delivered to
	// someone, so that their absence at rec is not just slowness.
	marker := newRecorder()
	defer h.Subscribe(marker, []string{"a"}).Close()
	publish(t, h, "a", "marker")
	marker.waitFor(t, 1)

	got := rec.all()
	if len(got) != 1 || got[0].ev.Pos != want {
		t.Errorf("got %d events (%v), want only the one published while subscribed", len(got), seqsBySlot(got))
	}
}

// SPEC S5: order is strict within a channel, for every subscriber, however
// many publishers race.
func TestHubKeepsChannelOrderWithConcurrentPublishers(t *testing.T) {
	h := newTestHub(t)
	channels := []string{"a", "b", "c"}
	subs := map[*recorder][]string{
		newRecorder(): {"a", "b", "c"},
		newRecorder(): {"c", "a"},
		newRecorder(): {"b"},
		newRecorder(): {"a", "a"}, // one channel twice: two slots
	}
	for rec, chs := range subs {
		rec.yield = true
		defer h.Subscribe(rec, chs).Close()
	}

	const publishers, each = 6, 300
	published := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for p := range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 7))
			for range each {
				ch := channels[rng.IntN(len(channels))]
				if _, err := h.Publish(context.Background(), ch, Message{Data: []byte(ch)}, replay.Limits{Count: 10}); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				published[ch]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()

	for rec, chs := range subs {
		total := 0
		for _, ch := range chs {
			total += published[ch]
		}
		bySlot := seqsBySlot(rec.waitFor(t, total))
		for slot, ch := range chs {
			if want := seqsUpTo(published[ch]); !slices.Equal(bySlot[slot], want) {
				t.Errorf("subscriber of %v, slot %d (%s): %d events not 1..%d in order", chs, slot, ch, len(bySlot[slot]), published[ch])
			}
		}
	}
}

func seqsUpTo(n int) []uint64 {
	s := make([]uint64, n)
	for i := range s {
		s[i] = uint64(i + 1)
	}
	return s
}

// Leaving is a swap-remove in the channel's list. Random joins and leaves
// check it against a model: every open subscription gets every event of its
// channels from when it joined, a closed one gets nothing more, and the
// subscriber counts match.
func TestSubscriptionCloseRemovesOnlyThatSubscriber(t *testing.T) {
	h := newTestHub(t)
	channels := []string{"a", "b", "c"}
	rng := rand.New(rand.NewPCG(11, 12))

	type member struct {
		rec      *recorder
		sub      *Subscription
		channels []string
		want     int // events it must have received
		open     bool
	}
	var all, open []*member

	for step := range 2000 {
		switch {
		case len(open) == 0 || rng.IntN(100) < 55:
			var chs []string
			for n := 1 + rng.IntN(3); len(chs) < n; {
				chs = append(chs, channels[rng.IntN(len(channels))]) // duplicates allowed
			}
			m := &member{rec: newRecorder(), channels: chs, open: true}
			m.sub = h.Subscribe(m.rec, chs)
			all, open = append(all, m), append(open, m)
		default:
			i := rng.IntN(len(open))
			open[i].sub.Close()
			open[i].open = false
			open = slices.Delete(open, i, i+1)
		}

		ch := channels[rng.IntN(len(channels))]
		publish(t, h, ch, "x")
		for _, m := range open {
			m.want += countOf(m.channels, ch)
		}

		for _, c := range channels {
			want := 0
			for _, m := range open {
				want += countOf(m.channels, c)
			}
			if got := h.Subscribers(c); got != want {
				t.Fatalf("step %d: Subscribers(%s) = %d, want %d", step, c, got, want)
			}
		}
	}

	for i, m := range all {
		if got := m.rec.waitFor(t, m.want); len(got) != m.want {
			t.Errorf("subscriber %d (%v, open %v) got %d events, want %d", i, m.channels, m.open, len(got), m.want)
		}
	}
	for _, m := range open {
		m.sub.Close()
	}
	for _, c := range channels {
		if n := h.Subscribers(c); n != 0 {
			t.Errorf("Subscribers(%s) = %d after everyone left", c, n)
		}
	}
}

func countOf(list []string, s string) int {
	n := 0
	for _, x := range list {
		if x == s {
			n++
		}
	}
	return n
}

func TestSubscriptionCloseIsIdempotent(t *testing.T) {
	h := newTestHub(t)
	keep := newRecorder()
	defer h.Subscribe(keep, []string{"a"}).Close()
	sub := h.Subscribe(newRecorder(), []string{"a"})
	sub.Close()
	sub.Close() // must not remove keep
	var none *Subscription
	none.Close()

	if n := h.Subscribers("a"); n != 1 {
		t.Fatalf("Subscribers = %d after closing one of two twice, want 1", n)
	}
	publish(t, h, "a", "x")
	keep.waitFor(t, 1)
}

func TestHubSubscribersCount(t *testing.T) {
	h := newTestHub(t)
	if n := h.Subscribers("a"); n != 0 {
		t.Fatalf("Subscribers of an unknown channel = %d", n)
	}
	s1 := h.Subscribe(newRecorder(), []string{"a", "b"})
	s2 := h.Subscribe(newRecorder(), []string{"a"})
	s3 := h.Subscribe(newRecorder(), []string{"a", "a"})
	if a, b := h.Subscribers("a"), h.Subscribers("b"); a != 4 || b != 1 {
		t.Errorf("Subscribers = a:%d b:%d, want a:4 b:1", a, b)
	}
	s1.Close()
	if a, b := h.Subscribers("a"), h.Subscribers("b"); a != 3 || b != 0 {
		t.Errorf("after one left: a:%d b:%d, want a:3 b:0", a, b)
	}
	s3.Close()
	s2.Close()
	if a := h.Subscribers("a"); a != 0 {
		t.Errorf("after all left: a:%d", a)
	}
}

func TestHubReadGoesThroughBroker(t *testing.T) {
	h := newTestHub(t)
	var last replay.Position
	for i := range 5 {
		last = publish(t, h, "a", fmt.Sprint(i))
	}
	page, err := h.Read(context.Background(), "a", &replay.Position{}, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Events) != 5 || page.Truncated || page.Head != last {
		t.Errorf("Read = %d events, truncated %v, head %+v; want 5, false, %+v", len(page.Events), page.Truncated, page.Head, last)
	}
	if head, _ := h.Read(context.Background(), "a", nil, 100); head.Head != last || len(head.Events) != 0 {
		t.Errorf("Read(nil) = %+v, want head only", head)
	}
}

func TestHubCloseRefusesPublishAndRead(t *testing.T) {
	h := NewMemoryHub()
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	if _, err := h.Publish(context.Background(), "a", Message{}, replay.Limits{}); !errors.Is(err, ErrClosed) {
		t.Errorf("Publish after Close = %v, want ErrClosed", err)
	}
	if _, err := h.Read(context.Background(), "a", nil, 10); !errors.Is(err, ErrClosed) {
		t.Errorf("Read after Close = %v, want ErrClosed", err)
	}
	// The broker itself is closed too, not only the hub's front door.
	if _, err := h.Broker().Publish(context.Background(), "a", Message{}, replay.Limits{}); !errors.Is(err, ErrClosed) {
		t.Errorf("broker Publish after hub Close = %v, want ErrClosed", err)
	}
}

func TestMemoryBrokerLogHoldsPublishedEvents(t *testing.T) {
	h := newTestHub(t)
	publish(t, h, "a", "x")
	publish(t, h, "b", "y")
	mem, ok := h.Broker().(*Memory)
	if !ok {
		t.Fatalf("NewMemoryHub's broker is %T", h.Broker())
	}
	if channels, events, _ := mem.Log().Stats(); channels != 2 || events != 2 {
		t.Errorf("log holds %d channels, %d events; want 2, 2", channels, events)
	}
}

// The sweep of the embedded broker never forgets a quiet channel that the
// hub has subscribers on: its next event would start a new epoch, and
// every open stream on it would be ended as if it had missed events. Once
// the last subscriber has left, it is freed as before.
func TestMemoryBrokerSweepKeepsChannelsWithSubscribers(t *testing.T) {
	h := newTestHub(t)
	mem := h.Broker().(*Memory)
	lim := replay.Limits{MaxAge: time.Millisecond}
	pub := func(channel string) replay.Position {
		t.Helper()
		pos, err := h.Publish(context.Background(), channel, Message{Data: []byte("x")}, lim)
		if err != nil {
			t.Fatal(err)
		}
		return pos
	}
	rec := newRecorder()
	sub := h.Subscribe(rec, []string{"watched"})
	first := pub("watched")
	pub("idle")
	time.Sleep(20 * time.Millisecond) // both empty for far longer than 2*max age
	mem.Sweep()
	if channels, _, _ := mem.Log().Stats(); channels != 1 {
		t.Fatalf("%d channels after the sweep, want only the watched one", channels)
	}
	if next := pub("watched"); !first.Follows(next) {
		t.Fatalf("the watched channel's next event %+v does not follow %+v: a new history", next, first)
	}
	rec.waitFor(t, 2)

	sub.Close()
	time.Sleep(20 * time.Millisecond)
	mem.Sweep() // last seen watched by the previous sweep, 2*max age ago
	if channels, _, _ := mem.Log().Stats(); channels != 0 {
		t.Fatalf("%d channels after the last subscriber left, want 0", channels)
	}
}

// A quiet channel is forgotten after two max ages with no event and no
// stream (docs/DELIVERY.md), counted from when its last subscriber left: a
// stream that came and went between two sweeps (they run every minute)
// counts too. Its client holds ids naming the channel's head; forgotten at
// the next sweep, its reconnect would be told the channel was truncated
// though no event was missed.
func TestMemoryBrokerSweepKeepsAChannelWhoseSubscriberJustLeft(t *testing.T) {
	h := newTestHub(t)
	mem := h.Broker().(*Memory)
	lim := replay.Limits{MaxAge: time.Second}
	first, err := h.Publish(context.Background(), "quiet", Message{Data: []byte("x")}, lim)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2*lim.MaxAge + 50*time.Millisecond) // quiet, with no stream, for longer than 2*max age
	sub := h.Subscribe(newRecorder(), []string{"quiet"})
	sub.Close() // a short stream, between two sweeps
	mem.Sweep() // moments later (well within 2*max age of the stream's end)
	if channels, _, _ := mem.Log().Stats(); channels != 1 {
		t.Fatalf("%d channels right after its subscriber left, want the quiet one kept", channels)
	}
	next, err := h.Publish(context.Background(), "quiet", Message{Data: []byte("y")}, lim)
	if err != nil {
		t.Fatal(err)
	}
	if !first.Follows(next) {
		t.Fatalf("the next event %+v does not follow %+v: a new epoch, so the stream's cursor is truncated", next, first)
	}
}

// stubBroker observes what the hub asks of its broker. It delivers its
// publishes itself, one at a time, like a broker receiving them from Redis.
type stubBroker struct {
	deliver DeliverFunc

	pubMu sync.Mutex // orders publishes; never held with mu
	seq   map[string]uint64

	mu         sync.Mutex
	watched    map[string]bool
	watches    map[string]int
	unwatches  map[string]int
	violations []string
	closes     int
}

func newStubHub(t *testing.T) (*Hub, *stubBroker) {
	stub := &stubBroker{
		seq: map[string]uint64{}, watched: map[string]bool{},
		watches: map[string]int{}, unwatches: map[string]int{},
	}
	h := NewHub(func(d DeliverFunc) Broker { stub.deliver = d; return stub })
	t.Cleanup(func() { h.Close() })
	return h, stub
}

func (s *stubBroker) Publish(_ context.Context, channel string, msg Message, _ replay.Limits) (replay.Position, error) {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	s.seq[channel]++
	ev := &replay.Event{Pos: replay.Position{Epoch: 1, Seq: s.seq[channel], Time: 1}, Frame: msg.Data}
	s.deliver(channel, ev)
	return ev.Pos, nil
}

func (s *stubBroker) Read(context.Context, string, *replay.Position, int) (replay.Page, error) {
	return replay.Page{}, nil
}

func (s *stubBroker) Watch(channel string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.watched[channel] {
		s.violations = append(s.violations, "Watch("+channel+") while watched")
	}
	s.watched[channel] = true
	s.watches[channel]++
}

func (s *stubBroker) Unwatch(channel string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.watched[channel] {
		s.violations = append(s.violations, "Unwatch("+channel+") while not watched")
	}
	delete(s.watched, channel)
	s.unwatches[channel]++
}

func (s *stubBroker) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closes++
	return nil
}

func (s *stubBroker) state(channel string) (watched bool, watches, unwatches int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.watched[channel], s.watches[channel], s.unwatches[channel]
}

func TestHubWatchesOnFirstSubscriberAndUnwatchesAfterLast(t *testing.T) {
	h, stub := newStubHub(t)
	check := func(when string, watched bool, watches, unwatches int) {
		t.Helper()
		w, ws, us := stub.state("a")
		if w != watched || ws != watches || us != unwatches {
			t.Errorf("%s: watched %v, %d Watch, %d Unwatch; want %v, %d, %d", when, w, ws, us, watched, watches, unwatches)
		}
	}
	check("before", false, 0, 0)
	s1 := h.Subscribe(newRecorder(), []string{"a"})
	check("first subscriber", true, 1, 0)
	s2 := h.Subscribe(newRecorder(), []string{"a", "a"})
	check("second subscriber", true, 1, 0)
	s1.Close()
	check("one left", true, 1, 0)
	s2.Close()
	check("last left", false, 1, 1)
	s3 := h.Subscribe(newRecorder(), []string{"a"})
	check("new first subscriber", true, 2, 1)
	s3.Close()
	check("new last left", false, 2, 2)
}

func TestHubCloseClosesBrokerOnce(t *testing.T) {
	h, stub := newStubHub(t)
	h.Close()
	h.Close()
	stub.mu.Lock()
	defer stub.mu.Unlock()
	if stub.closes != 1 {
		t.Errorf("broker closed %d times, want 1", stub.closes)
	}
}

// Watch and Unwatch of a channel must alternate however subscriptions race
// (the Redis broker subscribes and unsubscribes on them), while publishes
// are delivered to the same channels.
func TestHubWatchUnwatchAlternateUnderConcurrency(t *testing.T) {
	h, stub := newStubHub(t)
	channels := []string{"a", "b", "c", "d"}
	stop := make(chan struct{})
	var pubs sync.WaitGroup
	pubs.Add(1)
	go func() {
		defer pubs.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
				h.Publish(context.Background(), channels[i%len(channels)], Message{}, replay.Limits{})
			}
		}
	}()

	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 99))
			var held []*Subscription
			for range 300 {
				if len(held) > 0 && rng.IntN(2) == 0 {
					i := rng.IntN(len(held))
					held[i].Close()
					held = slices.Delete(held, i, i+1)
					continue
				}
				held = append(held, h.Subscribe(newRecorder(), []string{channels[rng.IntN(len(channels))]}))
			}
			for _, s := range held {
				s.Close()
			}
		}()
	}
	wg.Wait()
	close(stop)
	pubs.Wait()

	stub.mu.Lock()
	defer stub.mu.Unlock()
	for _, v := range stub.violations {
		t.Error(v)
	}
	for _, ch := range channels {
		if stub.watched[ch] || stub.watches[ch] != stub.unwatches[ch] || stub.watches[ch] == 0 {
			t.Errorf("channel %s: watched %v, %d Watch, %d Unwatch after everyone left", ch, stub.watched[ch], stub.watches[ch], stub.unwatches[ch])
		}
		if n := h.Subscribers(ch); n != 0 {
			t.Errorf("Subscribers(%s) = %d after everyone left", ch, n)
		}
	}
}

// countingSubscriber counts without allocating or locking: it is only ever
// given one channel's events, which are delivered one at a time.
type countingSubscriber struct{ n int }

func (c *countingSubscriber) Deliver(int, *replay.Event) { c.n++ }

// SPEC S3: no allocation per subscriber per event. A publish costs the same
// allocations with 1000 subscribers as with none.
func TestHubDeliverDoesNotAllocatePerSubscriber(t *testing.T) {
	h := newTestHub(t)
	msg := Message{Type: "t", Data: []byte("payload")}
	lim := replay.Limits{Count: 16}
	pub := func() {
		if _, err := h.Publish(context.Background(), "a", msg, lim); err != nil {
			t.Fatal(err)
		}
	}
	pub() // create the channel's ring
	alone := testing.AllocsPerRun(200, pub)

	subs := make([]countingSubscriber, 1000)
	for i := range subs {
		defer h.Subscribe(&subs[i], []string{"a"}).Close()
	}
	crowded := testing.AllocsPerRun(200, pub)
	if crowded > alone+1 {
		t.Errorf("a publish allocates %v times with 1000 subscribers and %v with none", crowded, alone)
	}
	if subs[0].n == 0 || subs[999].n != subs[0].n {
		t.Errorf("subscribers were not all delivered to: first %d, last %d", subs[0].n, subs[999].n)
	}
}
