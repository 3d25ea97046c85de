package main

import (
	"context"
	"errors"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// offeringPublisher answers the first publish of seq 2 with a 503 that
// offers a key, and takes it only under that key: a chaos plan retries
// it under the key, and counts it once, as accepted.
type offeringPublisher struct {
	mu   sync.Mutex
	keys []string // the key of every call
}

func (p *offeringPublisher) publish(_ context.Context, _, _ string, data []byte, key string) error {
	ev, _ := parseBenchData(data)
	p.mu.Lock()
	p.keys = append(p.keys, key)
	p.mu.Unlock()
	if ev.seq == 2 && key != "sse-retry-x" {
		return &failedPublish{err: errors.New(`publish: status 503 {"idempotency_key":"sse-retry-x"}`), key: "sse-retry-x"}
	}
	return nil
}
func (*offeringPublisher) close() {}

func TestChaosPlanRetriesUnderTheOfferedKey(t *testing.T) {
	for _, retry := range []bool{false, true} {
		p := &offeringPublisher{}
		pres := runPublish(context.Background(), p, pubPlan{
			channels: []string{"bench0"}, count: 3, chanOf: func(int) int { return 0 }, workers: 1, ordered: true, event: "tick",
			retryOffered: retry, retries: chaosRetries, retryWait: 1,
		})
		wantOK, wantFailed, wantKeys := int64(2), int64(1), "||"
		if retry {
			wantOK, wantFailed, wantKeys = 3, 0, "||sse-retry-x|"
		}
		if pres.ok.Load() != wantOK || pres.failed.Load() != wantFailed || strings.Join(p.keys, "|") != wantKeys {
			t.Fatalf("retryOffered %v: ok %d failed %d, keys %q", retry, pres.ok.Load(), pres.failed.Load(), p.keys)
		}
		if retry && !pres.accepted[0].has(2) {
			t.Fatal("the retried publish is not counted as accepted")
		}
		for e := range pres.errs {
			if strings.Contains(e, "sse-retry-x") {
				t.Fatalf("the error count keeps the offered key: %q", e)
			}
		}
	}
}

func TestChaosFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"fanout", "-chaos", "kill-redis,reload", "-spawn-redis", "redis-server", "-config", "c", "-admin", "127.0.0.1:1"}, ""},
		{[]string{"fanout", "-chaos", "explode"}, "unknown action"},
		{[]string{"idle", "-chaos", "reload", "-config", "c", "-admin", "127.0.0.1:1"}, "only fanout"},
		{[]string{"fanout", "-chaos", "kill-redis"}, "need -spawn-redis"},
		{[]string{"fanout", "-chaos", "stop-redis", "-spawn-redis", "redis-server", "-chaos-every", "1s", "-chaos-down", "2s"}, "must be longer"},
		{[]string{"fanout", "-chaos", "reload"}, "needs -config and -admin"},
	} {
		_, err := parseArgs(tc.args)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%q: %v, want %q", tc.args, err, tc.err)
		}
	}
}

// -chaos kill-redis and stop-redis act on the spawned Redis alone (here
// the streams' server is the in-process fake, which does not use it), start
// it again on its port, and the run stops the Redis it started last: nothing
// is left listening. The run is long enough for the second action on a
// loaded box: the next action waits -chaos-every after the last one ends
// (Redis restarted), and a 2 s run beside a CPU hog and the other test
// lane ended before it.
func TestChaosRedisActionsLeaveNothingRunning(t *testing.T) {
	redisBin := needRedis(t)
	base := serve(t, newFakeSSE())
	port := strconv.Itoa(freePorts(t, 1)[0])
	args := append([]string{"fanout", "-conns", "20", "-rate", "20", "-duration", "4s", "-channel-prefix", "cr",
		"-spawn-redis", redisBin, "-redis-port", port,
		"-chaos", "kill-redis,stop-redis", "-chaos-every", "400ms", "-chaos-down", "100ms"}, common(base)...)
	res, summary := runScenario(t, args...)
	checkDelivery(t, res, 20, 20*80)
	if len(res.Chaos) < 2 || res.Chaos[0].Action != "kill-redis" || res.Chaos[1].Action != "stop-redis" {
		t.Fatalf("chaos %+v\n%s", res.Chaos, summary)
	}
	for _, c := range res.Chaos {
		if c.Error != "" || c.DownS != 0.1 {
			t.Fatalf("chaos %+v", res.Chaos)
		}
	}
	if res.Redis != nil || !strings.Contains(summary, "-chaos killed and restarted it") {
		t.Fatalf("Redis figures over two processes: %+v\n%s", res.Redis, summary)
	}
	if c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, time.Second); err == nil {
		c.Close()
		t.Fatalf("a Redis still listens on %s after the run", port)
	}
}

// TestSpawnRedisRefusesABusyPort starts -spawn-redis on a -redis-port where
// another Redis already listens: the one started there cannot listen and
// exits, and the other one answers its PING. The run must not go on with a
// Redis it did not start: its figures would be of a dead process, and
// -chaos kill-redis would kill nothing while the run reported the servers
// unharmed by Redis' deaths.
func TestSpawnRedisRefusesABusyPort(t *testing.T) {
	redisBin := needRedis(t)
	port := strconv.Itoa(freePorts(t, 1)[0])
	other := exec.Command(redisBin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Process.Kill(); _ = other.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for dialReady("127.0.0.1:"+port, false) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the other Redis does not listen")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cfg, err := parseArgs([]string{"fanout", "-q", "-spawn-redis", redisBin, "-redis-port", port})
	if err != nil {
		t.Fatal(err)
	}
	r := newRunner(cfg, io.Discard, io.Discard)
	defer r.stopServer()
	if err := r.spawnRedisServer(); err == nil || !strings.Contains(err.Error(), "already listens") {
		t.Fatalf("spawned on a busy port: %v", err)
	}
}

// The measured window of a chaos run covers the wait for the last fault
// to end: the publishing ends while a fault is under way (here a reload
// that takes 1.5 s, from 0.7 s), the run waits for it, and what arrives
// and what the server does meanwhile is counted, so the time must be too.
// The window was the publishing's time plus the drain's, without that
// wait: deliveries/s and CPU cores came out high.
func TestChaosWindowCoversTheLastFault(t *testing.T) {
	base := serve(t, newFakeSSE())
	cfgFile, admin := fakeReload(t, base)
	args := append([]string{"fanout", "-conns", "10", "-rate", "20", "-duration", "1s", "-channel-prefix", "chaoswin",
		"-chaos", "reload", "-chaos-every", "700ms", "-chaos-down", "100ms", "-admin", admin, "-config", cfgFile,
		"-reload-cmd", "sleep 1.5"}, common(base)...)
	res, _ := runScenario(t, args...)
	checkDelivery(t, res, 10, 10*20)
	if len(res.Chaos) != 1 {
		t.Fatalf("chaos %+v: want the one reload at 0.7 s", res.Chaos)
	}
	d := res.Delivery
	window := float64(d.Received) / d.OverallPerS
	if window < 2.1 { // 0.7 s + the reload's 1.5 s, at least
		t.Fatalf("window %.2f s (%d received at %.0f/s overall); the last reload ended after 2.2 s", window, d.Received, d.OverallPerS)
	}
}
