package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// acceptedUpTo is what the server accepted when every publish to channel ch
// succeeded, for lasts[ch] events.
func acceptedUpTo(lasts ...int64) []chanAccepted {
	acc := make([]chanAccepted, len(lasts))
	for ch, n := range lasts {
		acc[ch] = chanAccepted{N: n, Last: n}
	}
	return acc
}

// lossyPublisher is a server seen through the publisher interface: it
// delivers each event to the client at once, except seq 2, which it accepts
// (200) and loses; seq 4 it delivers, but its reply is lost (the publish
// fails on the tool's side, e.g. a timeout).
type lossyPublisher struct {
	c *client
}

func (p lossyPublisher) publish(_ context.Context, _, event string, data []byte, _ string) error {
	ev, _ := parseBenchData(data)
	if ev.seq != 2 {
		frame := "event: " + event + "\ndata: " + string(data) + fmt.Sprintf("\nid: %d\n\n", ev.seq)
		if err := p.c.feed([]byte(frame), monoNow()); err != nil {
			return err
		}
	}
	if ev.seq == 4 {
		return errors.New("publish: timeout")
	}
	return nil
}
func (lossyPublisher) close() {}

// Losses are the accepted events (publishes that got a 200) not received,
// per client and channel, not "accepted" minus "distinct events received":
// an event whose publish failed on the tool's side but that the server
// delivered anyway must not hide a genuine loss of another. Seq 2 got a 200
// and never arrived: lost must be 1, and seq 4 is extra.
func TestFailedPublishMasksNoLoss(t *testing.T) {
	tgt := &target{raw: "http://127.0.0.1:1/e", url: mustURL(t, "http://127.0.0.1:1/e")}
	st := &stats{}
	c := newClient(0, tgt, []int64{0}, []string{"bench0"}, false, 0, st)
	pres := runPublish(context.Background(), lossyPublisher{c}, pubPlan{
		channels: []string{"bench0"}, count: 4, chanOf: func(int) int { return 0 }, workers: 1, ordered: true, event: "tick",
	})
	if pres.ok.Load() != 3 || pres.failed.Load() != 1 || c.uniq[0].Load() != 3 {
		t.Fatalf("setup: ok %d failed %d received %d", pres.ok.Load(), pres.failed.Load(), c.uniq[0].Load())
	}
	tl := countDelivered([]*client{c}, acceptedPerChannel(pres))
	if tl.lost != 1 || tl.expected != 3 || tl.unique != 2 || tl.extra != 1 || tl.complete != 0 {
		t.Fatalf("tally %+v: lost %d, want 1 (seq 2 was accepted and never delivered; the delivered-but-failed seq 4 masks it)", tl, tl.lost)
	}
}

// countWire, over the workers' tallies made against what the server
// accepted, must agree with countDelivered when publishes failed: a
// delivered event whose publish failed (a hole, or above the last accepted
// one) is extra and makes up for no lost one.
func TestCountWireFailedPublishes(t *testing.T) {
	k := newCore(engineOpts{}, 1)
	tgt := &target{raw: "http://127.0.0.1/x", url: mustURL(t, "http://127.0.0.1/x")}
	frame := func(ch, seq int64) string {
		return "event: tick\ndata: " + string(appendBenchData(nil, benchEvent{ch: ch, seq: seq, t: 1}, 0)) + "\n\n"
	}
	var clients []*client
	for i := range 12 {
		ch := int64(i % 2)
		c := newClient(i, tgt, []int64{ch}, []string{"a"}, false, 0, k.shards[0])
		var in string
		for seq := int64(1); seq <= 6; seq++ {
			if (seq+int64(i))%4 != 0 { // each client misses some
				in += frame(ch, seq)
			}
		}
		if err := c.feed([]byte(in), 2); err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	// channel 0: 2 and 4 failed, 6 was never tried; channel 1: 6 failed
	var sets [2]seqSet
	for _, seq := range []int64{1, 3, 5} {
		sets[0].add(seq)
	}
	for _, seq := range []int64{1, 2, 3, 4, 5} {
		sets[1].add(seq)
	}
	acc := []chanAccepted{acceptedOf(&sets[0]), acceptedOf(&sets[1])}
	if a := acc[0]; a.N != 3 || a.Last != 5 || len(a.Holes) != 2 {
		t.Fatalf("accepted %+v, want 3 up to 5 with 2 holes", a)
	}
	want := countDelivered(clients, acc)
	var lost, extra int64
	for i := range clients {
		for seq := int64(1); seq <= 6; seq++ {
			received := (seq+int64(i))%4 != 0
			switch accepted := sets[i%2].has(seq); {
			case accepted && !received:
				lost++
			case !accepted && received:
				extra++
			}
		}
	}
	if want.lost != lost || want.extra != extra || want.expected != 6*3+6*5 || want.unique != want.expected-lost {
		t.Fatalf("countDelivered %+v, want lost %d extra %d", want, lost, extra)
	}
	got := countWire([]*workerTally{workerTallyOf(clients[:5], 2, k, acc), workerTallyOf(clients[5:], 2, k, acc)}, acc)
	want.complete = 0
	if got != want {
		t.Fatalf("countWire %+v, countDelivered %+v", got, want)
	}
}

// failingPublishes answers 500 to the publishes of events with sequence
// number 5 (and delivers nothing for them); the rest goes to the hub.
func failingPublishes(hub http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path != "/load" {
			body, _ := io.ReadAll(r.Body)
			if bytes.Contains(body, []byte(`"s":5,`)) {
				http.Error(w, `{"error":"nope"}`, http.StatusInternalServerError)
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		hub.ServeHTTP(w, r)
	})
}

// A reconnect storm whose publishes failed does not pass: nothing is lost
// of what the server accepted, but the tool cannot vouch for the rest.
func TestReconnectFailsOnFailedPublishes(t *testing.T) {
	base := serve(t, failingPublishes(newFakeSSE()))
	cfgFile := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(cfgFile, []byte("# reload\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"reconnect", "-conns", "20", "-events", "8", "-rate", "40", "-channel-prefix", "rf",
		"-admin", strings.TrimPrefix(base, "http://"), "-config", cfgFile, "-close-jitter", "500ms"}, common(base)...)
	code, res, stderr := runTool(t, args)
	if code == 0 || res.OK || res.Publish == nil || res.Publish.Failed != 1 || !strings.Contains(res.Error, "1 publishes failed") {
		t.Fatalf("exit %d ok %v publish %+v error %q: a storm with a failed publish passed\n%s", code, res.OK, res.Publish, res.Error, stderr.String())
	}
	if d := res.Delivery; d.Lost != 0 || d.Expected != 20*8 || d.PerS <= 0 || d.Received > 20*9 {
		t.Fatalf("delivery %+v, want nothing lost of 20×8 accepted, a rate, and the storm's deliveries only", d)
	}
	if !strings.Contains(stderr.String(), "1 FAILED") {
		t.Fatalf("the summary does not show the failed publish:\n%s", stderr.String())
	}
}
