package caddysse

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// A degraded stream that recovers is given, on a channel this instance did
// not follow when it opened, the events dated since it opened (less
// openedSlack). Events are dated by Redis' clock; the stream's opening was
// by this instance's: one whose clock was ahead of Redis' by more than the
// slack (here 20 s) left out the events published in the first seconds
// after the stream opened (all of those of a short outage), silently.
func TestADegradedStreamOnAnInstanceAheadOfRedisGetsTheEventsSinceItOpened(t *testing.T) {
	rds := redistest.Start(t)
	hub := startRedisHub(t, pubsub.RedisOptions{Addrs: []string{rds.Addr()}})
	for _, skew := range []time.Duration{20 * time.Second, -20 * time.Second} {
		channel := "a" + skew.String()
		h := handlerOnHub(hub, "")
		h.clock = func() time.Time { return time.Now().Add(skew) }
		if _, err := hub.Publish(context.Background(), channel, pubsub.Message{Data: []byte("before")}, h.limits); err != nil {
			t.Fatal(err)
		}
		s := newStream(h, []string{channel})
		s.began = h.now().UnixNano() // it opens, degraded
		sp, err := s.startingPoint(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		var last replay.Position
		for i := range 3 {
			if last, err = hub.Publish(context.Background(), channel, pubsub.Message{Data: []byte(strconv.Itoa(i))}, h.limits); err != nil {
				t.Fatal(err)
			}
		}
		sp.pages[0].Head = last // what the recovering stream's starting point reads now
		if err := s.addSinceOpened(context.Background(), &sp); err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, ev := range sp.pages[0].Events {
			got = append(got, string(ev.Frame))
		}
		// "before", published just before it opened, may be among them
		// (openedSlack); the three published since must
		if n := len(got); n < 3 || got[n-3] != "data: 0\n" || got[n-1] != "data: 2\n" {
			t.Errorf("instance clock %v off Redis': the recovering stream gets %q, want at least the 3 events published since it opened", skew, got)
		}
	}
}

// A namespaced channel's events are in Redis under the namespaced name, on
// that name's primary, whose clock dates them. A recovering stream read the
// clock of the primary of the name without its namespace: on a cluster,
// another primary (whose clock may be off the channel's), and while that
// one does not answer (here paused, as when it fails over or hangs) the
// catch-up of a channel whose own primary answers failed, and the stream
// stayed degraded.
func TestADegradedNamespacedStreamOnAClusterReadsItsChannelsPrimaryClock(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	hub := startRedisHub(t, pubsub.RedisOptions{Addrs: cluster.Addrs(), ReadTimeout: 300 * time.Millisecond, MaxRetries: -1})
	h := handlerOnHub(hub, "ns")
	var channel string
	for i := 0; channel == ""; i++ {
		c := "c" + strconv.Itoa(i)
		if cluster.NodeOfSlot(t, redistest.SlotOf(c)) != cluster.NodeOfSlot(t, redistest.SlotOf(h.channelKey(c))) {
			channel = c
		}
	}
	ctx := context.Background()
	if _, err := hub.Publish(ctx, h.channelKey(channel), pubsub.Message{Data: []byte("before")}, h.limits); err != nil {
		t.Fatal(err)
	}
	s := newStream(h, []string{channel})
	s.began = h.now().UnixNano() // it opens, degraded
	sp, err := s.startingPoint(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var last replay.Position
	for i := range 3 {
		if last, err = hub.Publish(ctx, h.channelKey(channel), pubsub.Message{Data: []byte(strconv.Itoa(i))}, h.limits); err != nil {
			t.Fatal(err)
		}
	}
	sp.pages[0].Head = last
	other := cluster.NodeOfSlot(t, redistest.SlotOf(channel))
	other.MustCLI("CLIENT", "PAUSE", "3000", "ALL") // the primary of the name without its namespace
	t.Cleanup(func() { _, _ = other.CLI("CLIENT", "UNPAUSE") })
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.addSinceOpened(ctx, &sp); err != nil {
		t.Fatalf("the channel's primary answers, another does not: %v", err)
	}
	if n := len(sp.pages[0].Events); n < 3 {
		t.Errorf("the recovering stream gets %d events, want the 3 published since it opened", n)
	}
}

// Streams that opened degraded during an outage, each on a channel this
// instance did not follow then (one per user, say), all recover when Redis
// answers again. Each read its channel's history, and each also asked
// Redis for the time: a second round trip per stream and channel, in the
// herd that reconnects at once. The primary's clock is read once for all
// of them.
func TestDegradedStreamsRecoveringAtOnceReadRedisClockOnce(t *testing.T) {
	rds := redistest.Start(t)
	hub := startRedisHub(t, pubsub.RedisOptions{Addrs: []string{rds.Addr()}})
	h := handlerOnHub(hub, "")
	ctx := context.Background()
	const n = 100
	streams := make([]*stream, n)
	sps := make([]startingPoint, n)
	for i := range streams {
		channel := "user" + strconv.Itoa(i)
		s := newStream(h, []string{channel})
		s.began = h.now().UnixNano()
		sp, err := s.startingPoint(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		last, err := hub.Publish(ctx, channel, pubsub.Message{Data: []byte("since")}, h.limits)
		if err != nil {
			t.Fatal(err)
		}
		sp.pages[0].Head = last
		streams[i], sps[i] = s, sp
	}
	rds.MustCLI("CONFIG", "RESETSTAT")
	errs := make(chan error, n)
	for i, s := range streams {
		go func() { errs <- s.addSinceOpened(ctx, &sps[i]) }()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for i := range sps {
		if len(sps[i].pages[0].Events) != 1 {
			t.Fatalf("stream %d gets %d events, want the one published since it opened", i, len(sps[i].pages[0].Events))
		}
	}
	stats := rds.MustCLI("INFO", "commandstats")
	calls := func(stat string) int {
		for _, line := range strings.Split(stats, "\n") {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), stat+":calls="); ok {
				c, _ := strconv.Atoi(strings.SplitN(rest, ",", 2)[0])
				return c
			}
		}
		return 0
	}
	reads := calls("cmdstat_fcall_ro") + calls("cmdstat_evalsha_ro") + calls("cmdstat_evalsha") + calls("cmdstat_eval")
	// each read runs TIME inside Redis (now_ms): those are counted too
	if direct := calls("cmdstat_time") - reads; direct > 5 {
		t.Errorf("%d streams recovering at once asked Redis for the time %d times besides their %d reads", n, direct, reads)
	}
}

// hungClock is the embedded broker with a clock of its own that does not
// answer (a Redis primary that hangs, whose TIME go-redis waits out through
// its read timeouts and retries, whatever the context says).
type hungClock struct {
	*pubsub.Memory
	asked   chan struct{}
	release chan struct{}
}

func (b hungClock) Now(context.Context, string) (time.Time, error) {
	b.asked <- struct{}{}
	<-b.release
	return time.Time{}, pubsub.ErrUnavailable
}

// A recovering stream's reads of the history stop once closing has begun
// (readHistory: a reload or a stop does not wait for a backend that
// hangs); its read of the clock did not: the stream, told server_closing,
// stayed in addSinceOpened for as long as the backend hung.
func TestARecoveringStreamDoesNotWaitForAHungClockOnceClosing(t *testing.T) {
	asked, release := make(chan struct{}, 1), make(chan struct{})
	t.Cleanup(func() { close(release) })
	hub := pubsub.NewHub(func(d pubsub.DeliverFunc) pubsub.Broker { return hungClock{pubsub.NewMemory(d), asked, release} })
	t.Cleanup(func() { _ = hub.Close() })
	h := validHandler()
	h.logger = zap.NewNop()
	h.metrics = newMetrics()
	h.hub = hub
	h.limits = h.hubLimits()
	h.streams = newRegistry(h.logger, 0, 0, 0)
	ctx := context.Background()
	s := newStream(h, []string{"a"})
	s.began = h.now().UnixNano()
	sp, err := s.startingPoint(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	s.begun = true // registered
	last, err := hub.Publish(ctx, "a", pubsub.Message{Data: []byte("since")}, h.limits)
	if err != nil {
		t.Fatal(err)
	}
	sp.pages[0].Head = last
	done := make(chan error, 1)
	go func() { done <- s.addSinceOpened(ctx, &sp) }()
	<-asked // it has read the history, and waits for the clock
	h.streams.closeAll("reload")
	select {
	case err := <-done:
		if !errors.Is(err, errClosing) {
			t.Fatalf("got %v, want errClosing", err)
		}
	case <-time.After(5 * time.Second): // a bound to fail by, not a wait
		t.Fatal("the stream, told to close, still waits for the backend's clock")
	}
}

// startRedisHub starts a hub on Redis, closed when the test ends.
func startRedisHub(t *testing.T, opts pubsub.RedisOptions) *pubsub.Hub {
	t.Helper()
	hub, err := pubsub.NewRedisHub(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hub.Close() })
	return hub
}

// handlerOnHub is a handler (not provisioned: its streams are driven by
// hand) on hub, with namespace.
func handlerOnHub(hub *pubsub.Hub, namespace string) *Handler {
	h := validHandler()
	h.Namespace = namespace
	h.logger = zap.NewNop()
	h.metrics = newMetrics()
	h.hub = hub
	h.limits = h.hubLimits()
	return h
}
