package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/uring"

	"github.com/caddy-sse/caddy-sse/internal/freeport"
)

// TestMain also runs the test binary as the processes a run starts: a
// subscriber worker (-procs re-executes the tool, here the test binary),
// a floor server (a server of a run that did not start it), a process
// tree of proctree_test.go (procHelperCommand), or a spawned
// Redis-backed fake server (SSEBENCH_SMOKE_SERVER=<addr>).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == workerCommand {
		os.Exit(runWorker(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "floor-server" {
		os.Exit(runFloorServer(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == procHelperCommand {
		os.Exit(runProcHelper(os.Args[2:]))
	}
	if addr := os.Getenv("SSEBENCH_SMOKE_SERVER"); addr != "" {
		if err := runFakeRedisServer(addr, os.Getenv("SSEBENCH_REDIS")); err != nil {
			fmt.Fprintln(os.Stderr, "fake redis server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// fakeSSE is a minimal in-process SSE server with the module's HTTP
// surface: GET streams (one channel per stream here, ids "<channel>:<seq>",
// Last-Event-ID replay), POST publishes with a bearer secret and replies
// {"ids": ...}, and POST /load ends every stream with server_closing and
// retry: 50, like a reload.
type fakeSSE struct {
	mu   sync.Mutex
	log  map[string][][]byte // per channel, the frames by seq-1
	subs map[*fakeSub]bool
	// reverseReplay replays the missed events newest first (a broken
	// server, for the tests of what a run counts as a fault)
	reverseReplay bool
}

type fakeSub struct {
	channel string
	frames  chan []byte
	closing chan struct{}
}

func newFakeSSE() *fakeSSE {
	return &fakeSSE{log: map[string][][]byte{}, subs: map[*fakeSub]bool{}}
}

func (f *fakeSSE) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/load" && r.Method == http.MethodPost:
		f.mu.Lock()
		for s := range f.subs {
			close(s.closing)
			delete(f.subs, s)
		}
		f.mu.Unlock()
	case r.Method == http.MethodPost:
		f.publish(w, r)
	case r.Method == http.MethodGet:
		f.stream(w, r)
	default:
		http.Error(w, "no", http.StatusMethodNotAllowed)
	}
}

// smokePublish is a publish request as the test servers take it.
type smokePublish struct {
	Channel string          `json:"channel"`
	Event   string          `json:"event"`
	Data    json.RawMessage `json:"data"`
}

// readSmokePublish checks the secret and decodes a publish request, with
// its data compacted; false once it has answered with an error.
func readSmokePublish(w http.ResponseWriter, r *http.Request) (smokePublish, []byte, bool) {
	var body smokePublish
	if r.Header.Get("Authorization") != "Bearer smoke" {
		http.Error(w, `{"error":"unauthorized"}`, http.StatusUnauthorized)
		return body, nil, false
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.Channel == "" {
		http.Error(w, `{"error":"json_invalid"}`, http.StatusBadRequest)
		return body, nil, false
	}
	var data bytes.Buffer
	_ = json.Compact(&data, body.Data)
	return body, data.Bytes(), true
}

func (f *fakeSSE) publish(w http.ResponseWriter, r *http.Request) {
	body, data, ok := readSmokePublish(w, r)
	if !ok {
		return
	}
	f.mu.Lock()
	seq := len(f.log[body.Channel]) + 1
	id := fmt.Sprintf("%s:%d", body.Channel, seq)
	frame := []byte(fmt.Sprintf("event: %s\ndata: %s\nid: %s\n\n", body.Event, data, id))
	f.log[body.Channel] = append(f.log[body.Channel], frame)
	for s := range f.subs {
		if s.channel == body.Channel {
			select {
			case s.frames <- frame:
			default: // a stuck client: end its stream, it replays on reconnect
				close(s.closing)
				delete(f.subs, s)
			}
		}
	}
	f.mu.Unlock()
	fmt.Fprintf(w, `{"ids":{%q:%q}}`, body.Channel, id)
}

func (f *fakeSSE) stream(w http.ResponseWriter, r *http.Request) {
	ch := r.URL.Query().Get("channels")
	if ch == "" || strings.Contains(ch, ",") {
		http.Error(w, `{"error":"channel_invalid"}`, http.StatusBadRequest)
		return
	}
	after := -1 // a fresh stream starts live
	if id := r.Header.Get("Last-Event-ID"); id != "" {
		_, n, _ := strings.Cut(id, ":")
		after, _ = strconv.Atoi(n)
	}
	s := &fakeSub{channel: ch, frames: make(chan []byte, 1024), closing: make(chan struct{})}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	fmt.Fprint(w, ": ok\nretry: 3000\n\n")
	f.mu.Lock()
	var replay []byte
	if after >= 0 && after < len(f.log[ch]) {
		missed := f.log[ch][after:]
		for i := range missed {
			if f.reverseReplay {
				i = len(missed) - 1 - i
			}
			replay = append(replay, missed[i]...)
		}
	}
	f.subs[s] = true
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.subs, s)
		f.mu.Unlock()
	}()
	_, _ = w.Write(replay)
	rc := http.NewResponseController(w)
	if rc.Flush() != nil {
		return
	}
	for {
		select {
		case fr := <-s.frames:
			_, _ = w.Write(fr)
			if rc.Flush() != nil {
				return
			}
		case <-s.closing:
			fmt.Fprint(w, "retry: 50\nevent: server_closing\ndata: {\"reason\":\"reload\"}\n\n")
			return
		case <-r.Context().Done():
			return
		}
	}
}

// serve starts h on a new loopback listener and returns its base URL.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// runScenario runs the tool in process and returns its result and output.
func runScenario(t *testing.T, args ...string) (*result, string) {
	t.Helper()
	code, res, stderr := runTool(t, args)
	if code != 0 || !res.OK {
		t.Fatalf("%s: exit %d, error %q\n%s", args[0], code, res.Error, stderr.String())
	}
	return &res, stderr.String()
}

func common(url string) []string {
	return []string{"-url", url + "/events", "-secret", "smoke", "-pid", strconv.Itoa(os.Getpid()),
		"-settle", "100ms", "-q", "-timeout", "60s", "-drain", "10s"}
}

func checkDelivery(t *testing.T, res *result, conns int, events int64) {
	t.Helper()
	d := res.Delivery
	if res.Ramp.Connected != int64(conns) || d.Clients != conns {
		t.Fatalf("connected %d, clients %d, want %d", res.Ramp.Connected, d.Clients, conns)
	}
	if d.Expected != events || d.Unique != events || d.Lost != 0 || d.Dupes != 0 || !d.Drained {
		t.Fatalf("delivery %+v, want %d events, nothing lost", d, events)
	}
	if res.Latency.N < uint64(events) || res.Latency.P99ms <= 0 || res.Latency.MaxMs < res.Latency.P50ms {
		t.Fatalf("latency %+v", res.Latency)
	}
	if res.Server == nil || res.Server.PID != os.Getpid() || res.Server.RSSKiB <= 0 || res.Client == nil {
		t.Fatalf("server %+v client %+v", res.Server, res.Client)
	}
}

// TestSmokeFanout runs fanout end to end, with both engines (the epoll
// one reading with read(2) and through io_uring), against the fake server.
func TestSmokeFanout(t *testing.T) {
	base := serve(t, newFakeSSE())
	withRing := "epoll+io_uring"
	if r, err := uring.New(8); err != nil {
		withRing = "epoll" // the engine falls back to read(2) here
	} else {
		r.Close()
	}
	for _, run := range []struct{ name, engine, uring, want string }{
		{"epoll", "epoll", "false", "epoll"},
		{"epoll+io_uring", "epoll", "true", withRing},
		{"std", "std", "false", "std"},
	} {
		t.Run(run.name, func(t *testing.T) {
			args := append([]string{"fanout", "-engine", run.engine, "-uring=" + run.uring, "-conns", "200", "-rate", "20", "-duration", "1s"}, common(base)...)
			if run.engine == "std" { // publishers that may overtake each other
				args = append(args, "-ordered=false", "-publishers", "8")
			}
			res, summary := runScenario(t, args...)
			checkDelivery(t, res, 200, 200*20)
			if res.Engine != run.want || !strings.Contains(summary, "latency:") {
				t.Fatalf("engine %q, want %q; summary:\n%s", res.Engine, run.want, summary)
			}
		})
	}
}

// fakeReload is a config file for -config and the admin address of the
// fake server at base, whose POST /load ends every stream like a reload.
func fakeReload(t *testing.T, base string) (cfgFile, admin string) {
	t.Helper()
	cfgFile = filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(cfgFile, []byte("# reload\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return cfgFile, strings.TrimPrefix(base, "http://")
}

// TestSmokeScenarios runs spread, scaleout, reconnect, a chaos of reloads
// and churn briefly.
func TestSmokeScenarios(t *testing.T) {
	hub := newFakeSSE()
	base, base2 := serve(t, hub), serve(t, hub)
	t.Run("spread", func(t *testing.T) {
		args := append([]string{"spread", "-conns", "100", "-channels", "10", "-rate", "50", "-duration", "1s"}, common(base)...)
		res, _ := runScenario(t, args...)
		checkDelivery(t, res, 100, 50*10) // each event reaches the 10 streams of its channel
	})
	t.Run("scaleout", func(t *testing.T) {
		args := append([]string{"scaleout", "-conns", "100", "-rate", "10", "-duration", "1s", "-channel-prefix", "so"}, common(base)...)
		args[len(args)-len(common(base))+1] = base + "/events," + base2 + "/events"
		res, _ := runScenario(t, args...)
		checkDelivery(t, res, 100, 100*10)
		if len(res.Targets) != 2 {
			t.Fatalf("targets %v", res.Targets)
		}
	})
	t.Run("reconnect", func(t *testing.T) {
		cfgFile, admin := fakeReload(t, base)
		args := append([]string{"reconnect", "-conns", "100", "-events", "20", "-rate", "40", "-channel-prefix", "rc",
			"-admin", admin, "-config", cfgFile, "-close-jitter", "1s"}, common(base)...)
		res, _ := runScenario(t, args...)
		rc := res.Reconnect
		if rc.Reconnected != 100 || rc.Complete != 100 || rc.ServerClosing != 100 || !rc.WithinBudget || res.Delivery.Lost != 0 || res.Delivery.Dupes != 0 {
			t.Fatalf("reconnect %+v delivery %+v", rc, res.Delivery)
		}
		if res.Delivery.Expected != 100*21 { // warm-up event + 20
			t.Fatalf("expected %d deliveries", res.Delivery.Expected)
		}
		// the latency is the storm's, as the deliveries are: not mixed
		// with the warm-up's, delivered to quiet streams
		if res.Latency.N != uint64(res.Delivery.Received) || res.Delivery.Received != 100*20 {
			t.Fatalf("latency of %d deliveries, %d received in the storm", res.Latency.N, res.Delivery.Received)
		}
	})
	t.Run("chaos-reload", func(t *testing.T) {
		cfgFile, admin := fakeReload(t, base)
		// 3 s for two reloads 500 ms apart: each waits for the last to end,
		// and a loaded box (a stress run) may slow them
		args := append([]string{"fanout", "-conns", "50", "-rate", "20", "-duration", "3s", "-channel-prefix", "chaos",
			"-chaos", "reload", "-chaos-every", "500ms", "-chaos-down", "100ms", "-admin", admin, "-config", cfgFile}, common(base)...)
		res, summary := runScenario(t, args...)
		checkDelivery(t, res, 50, 50*60)
		if len(res.Chaos) < 2 || res.Delivery.Closing < 50*int64(len(res.Chaos)) || !strings.Contains(summary, "chaos:     at ") {
			t.Fatalf("chaos %+v, delivery %+v\n%s", res.Chaos, res.Delivery, summary)
		}
		for _, c := range res.Chaos {
			if c.Action != "reload" || c.Target != admin || c.Error != "" {
				t.Fatalf("chaos %+v", res.Chaos)
			}
		}
	})
	t.Run("churn", func(t *testing.T) {
		args := append([]string{"churn", "-conn-rate", "200", "-hold", "200ms", "-duration", "1s"}, common(base)...)
		res, _ := runScenario(t, args...)
		c := res.Churn
		if c.Connected < 150 || c.Failed != 0 || c.ConnsPerS < 100 || res.Conn.ClosedByUs != c.Connected {
			t.Fatalf("churn %+v conns %+v", c, res.Conn)
		}
	})
}

// TestSpawnRefusesABusyPort checks that -spawn does not start a server on
// a port another process already listens on: with SO_REUSEPORT both would
// serve, and the run would measure the two.
func TestSpawnRefusesABusyPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cfg, err := parseArgs([]string{"fanout", "-url", "http://" + ln.Addr().String() + "/events", "-spawn", "true", "-q"})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if code := newRunner(cfg, &out, io.Discard).run(); code == 0 || !strings.Contains(out.String(), "already listens on "+ln.Addr().String()) {
		t.Fatalf("exit %d: %s", code, out.String())
	}
}

// TestRefusesNonLoopback checks the command refuses a non-loopback target
// before doing anything.
func TestRefusesNonLoopback(t *testing.T) {
	cfg, err := parseArgs([]string{"fanout", "-url", "http://192.0.2.1:9080/events", "-q"})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if code := newRunner(cfg, &out, io.Discard).run(); code == 0 || !strings.Contains(out.String(), "not a loopback address") {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	for _, args := range [][]string{
		{"nope"}, {"fanout", "-engine", "x"}, {"reconnect"}, {"scaleout"}, {"fanout", "-per-conn", "2"}, {"fanout", "extra"},
	} {
		if _, err := parseArgs(append(args, "-q")); err == nil {
			t.Errorf("parseArgs(%q) accepted", args)
		}
	}
}

// runFakeRedisServer is a fake server on Redis, the way the module uses it
// (simplified: live streams only, no replay): a publish runs the module's
// function sse_publish_v1 (with the tool's own Redis publisher), and a
// stream of channel C reads the announcements on the shard channel
// sse:{C} ("<epoch>:<seq>:<time>:<type length>:<type><data>"). Several of
// them on one Redis fan out to each other's streams.
func runFakeRedisServer(addr, redisURL string) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("SSEBENCH_REDIS %q: %v", redisURL, err)
	}
	pub := newRedisPublisher(opts, "sse:", 1000, 8, 5*time.Second)
	rdb := redis.NewClient(opts)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodPost:
			body, data, ok := readSmokePublish(w, r)
			if !ok {
				return
			}
			if err := pub.publish(r.Context(), body.Channel, body.Event, data, ""); err != nil {
				http.Error(w, `{"error":"publish_failed"}`, http.StatusServiceUnavailable)
				return
			}
			fmt.Fprint(w, `{"ids":{}}`)
		case http.MethodGet:
			ch := r.URL.Query().Get("channels")
			ps := rdb.SSubscribe(r.Context(), "sse:{"+ch+"}")
			defer ps.Close()
			if _, err := ps.Receive(r.Context()); err != nil { // subscribed before the 200
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			fmt.Fprint(w, ": ok\n\n")
			rc := http.NewResponseController(w)
			if rc.Flush() != nil {
				return
			}
			msgs := ps.Channel()
			for {
				select {
				case m, ok := <-msgs:
					if !ok {
						return
					}
					f := strings.SplitN(m.Payload, ":", 5)
					if len(f) < 5 {
						continue
					}
					n, _ := strconv.Atoi(f[3])
					n = min(n, len(f[4]))
					fmt.Fprintf(w, "event: %s\ndata: %s\nid: %s\n\n", f[4][:n], f[4][n:], f[1])
					if rc.Flush() != nil {
						return
					}
				case <-r.Context().Done():
					return
				}
			}
		default:
			http.Error(w, "no", http.StatusMethodNotAllowed)
		}
	})
	return http.ListenAndServe(addr, h)
}

// needRedis returns the redis-server binary, or skips the test when there
// is none (but fails in CI).
func needRedis(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is needed in CI: %v", err)
		}
		t.Skipf("no redis-server: %v", err)
	}
	return bin
}

// freePorts are ports for the test's servers, below the ephemeral range
// and kept from other test binaries (freeport): a port the kernel handed
// out for port 0 was free again for anyone's port 0 — the run's own Redis
// (-spawn-redis), another package's listener — before a server took it.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var out []int
	for len(out) < n {
		out = append(out, freeport.Get(t, false))
	}
	return out
}

// gone checks that a process this run started is no more.
func gone(t *testing.T, what string, pid int) {
	t.Helper()
	if pid <= 0 {
		t.Fatalf("%s: no pid", what)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("%s (pid %d) still exists after the run: %v", what, pid, err)
	}
}

// TestSmokeRedis runs the Redis setups end to end with a few streams: a
// spawned redis-server, two spawned servers on it (Redis-backed fake
// servers: the test binary), the streams held by two subscriber worker
// processes, events published through the first server's HTTP endpoint or
// straight into Redis with the module's function.
func TestSmokeRedis(t *testing.T) {
	redisBin := needRedis(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"-secret", "smoke", "-settle", "200ms", "-q", "-timeout", "90s", "-drain", "10s", "-spawn-redis", redisBin}
	t.Run("scaleout-procs", func(t *testing.T) {
		ports := freePorts(t, 2)
		urls := fmt.Sprintf("http://127.0.0.1:%d/events,http://127.0.0.1:%d/events", ports[0], ports[1])
		args := append([]string{"scaleout", "-url", urls, "-conns", "40", "-procs", "2", "-rate", "20", "-duration", "1s",
			"-spawn", fmt.Sprintf("SSEBENCH_SMOKE_SERVER=127.0.0.1:%d %s", ports[0], exe),
			"-spawn", fmt.Sprintf("SSEBENCH_SMOKE_SERVER=127.0.0.1:%d %s", ports[1], exe)}, base...)
		res, summary := runScenario(t, args...)
		d := res.Delivery
		if res.Ramp.Connected != 40 || d.Clients != 40 || d.Expected != 40*20 || d.Unique != 40*20 || d.Lost != 0 || d.Dupes != 0 || !d.Drained {
			t.Fatalf("ramp %+v delivery %+v\n%s", res.Ramp, d, summary)
		}
		if res.Latency.N != 40*20 || res.Latency.P99ms <= 0 {
			t.Fatalf("latency %+v", res.Latency)
		}
		s := res.Server
		if s == nil || len(s.PIDs) != 2 || len(s.Processes) != 2 || s.RSSKiB != s.Processes[0].RSSKiB+s.Processes[1].RSSKiB {
			t.Fatalf("server %+v", s)
		}
		if res.Redis == nil || res.Redis.RSSKiB <= 0 || !strings.HasPrefix(res.Redis.URL, "redis://127.0.0.1:") || strings.HasSuffix(res.Redis.URL, ":6379") {
			t.Fatalf("redis %+v", res.Redis)
		}
		if c := res.Client; c == nil || len(c.Procs) != 2 || c.Procs[0].Conns != 20 || c.Procs[1].URL == c.Procs[0].URL {
			t.Fatalf("client %+v", c)
		}
		if res.Conn == nil || res.Conn.Connected != 40 || res.Procs != 2 {
			t.Fatalf("connections %+v procs %d", res.Conn, res.Procs)
		}
		for i, pid := range s.PIDs {
			gone(t, fmt.Sprintf("server %d", i), pid)
		}
		gone(t, "redis", res.Redis.PID)
		for i, p := range res.Client.Procs {
			gone(t, fmt.Sprintf("worker %d", i), p.PID)
		}
	})
	t.Run("publish-redis", func(t *testing.T) {
		ports := freePorts(t, 1)
		args := append([]string{"fanout", "-url", fmt.Sprintf("http://127.0.0.1:%d/events", ports[0]), "-conns", "20", "-rate", "20", "-duration", "1s",
			"-publish-redis", "spawned", "-channel-prefix", "direct",
			"-spawn", fmt.Sprintf("SSEBENCH_SMOKE_SERVER=127.0.0.1:%d %s", ports[0], exe)}, base...)
		res, summary := runScenario(t, args...)
		d := res.Delivery
		if d.Expected != 20*20 || d.Unique != 20*20 || d.Lost != 0 || d.Dupes != 0 {
			t.Fatalf("delivery %+v\n%s", d, summary)
		}
		if !strings.HasPrefix(res.PublishTo, "redis://127.0.0.1:") || !strings.Contains(summary, "function library was loaded") {
			t.Fatalf("publish_url %q\n%s", res.PublishTo, summary)
		}
		gone(t, "redis", res.Redis.PID)
	})
}

// TestRedisPublisherScripts checks the publisher against a Redis that
// refuses functions: it runs the script form, and the event is in the
// channel's stream.
func TestRedisPublisherScripts(t *testing.T) {
	redisBin := needRedis(t)
	port := freePorts(t, 1)[0]
	cmd := exec.Command(redisBin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--protected-mode", "no", "--dir", t.TempDir(), "--rename-command", "FUNCTION", "")
	cmd.SysProcAttr = spawnAttrs()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	opts, err := parseRedisURL(context.Background(), fmt.Sprintf("redis://127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for rdb.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			t.Fatal("redis-server did not answer")
		}
		time.Sleep(20 * time.Millisecond)
	}
	p := newRedisPublisher(opts, "sse:", 1000, 2, 5*time.Second)
	var notes []string
	p.note = func(s string) { notes = append(notes, s) }
	for i := range 3 {
		if err := p.publish(context.Background(), "orders", "tick", []byte(fmt.Sprintf(`{"i":%d}`, i)), ""); err != nil {
			t.Fatal(err)
		}
	}
	p.close()
	if n, err := rdb.XLen(context.Background(), "sse:{orders}:s").Result(); err != nil || n != 3 {
		t.Fatalf("stream length %d, %v", n, err)
	}
	if seq, _ := rdb.HGet(context.Background(), "sse:{orders}:m", "s").Result(); seq != "3" {
		t.Fatalf("seq %q", seq)
	}
	if !p.scripts.Load() || len(notes) != 1 || !strings.Contains(notes[0], "script") {
		t.Fatalf("scripts %v notes %q", p.scripts.Load(), notes)
	}
	if _, err := parseRedisURL(context.Background(), "redis://192.0.2.1:6390"); err == nil {
		t.Fatal("a non-loopback Redis was accepted")
	}
}

// TestIdleCountsOpenStreams runs idle against a server that ends every
// stream soon after opening it: the memory per stream is that of the
// streams open when it is read, and a run whose streams are no longer
// open fails instead of dividing the server's memory by streams it no
// longer holds.
func TestIdleCountsOpenStreams(t *testing.T) {
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, ": ok\n\n")
		_ = http.NewResponseController(w).Flush()
		time.Sleep(20 * time.Millisecond)
	}))
	code, res, _ := runTool(t, append([]string{"idle", "-conns", "50", "-reconnect=false"}, common(base)...))
	if code == 0 || res.OK || !strings.Contains(res.Error, "open") {
		t.Fatalf("exit %d, ok %v, error %q: the streams had all ended", code, res.OK, res.Error)
	}
	if res.Server == nil || res.Server.RSSPerConnKiB != 0 {
		t.Fatalf("server %+v: no memory per stream without open streams", res.Server)
	}
}

// TestReconnectFailsOnStreamsNotOpened runs the reconnect storm with a
// server that refuses the first streams (an EventSource gives up on a
// 503): a storm of fewer clients than asked for is not the storm measured,
// and fails as fanout does, instead of reporting them all complete.
func TestReconnectFailsOnStreamsNotOpened(t *testing.T) {
	hub := newFakeSSE()
	var mu sync.Mutex
	refused := 0
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		refuse := r.Method == http.MethodGet && refused < 5
		if refuse {
			refused++
		}
		mu.Unlock()
		if refuse {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		hub.ServeHTTP(w, r)
	}))
	cfgFile, admin := fakeReload(t, base)
	args := append([]string{"reconnect", "-conns", "20", "-events", "10", "-rate", "40", "-channel-prefix", "rr",
		"-admin", admin, "-config", cfgFile, "-close-jitter", "1s"}, common(base)...)
	code, res, _ := runTool(t, args)
	if res.Ramp == nil || res.Ramp.Connected != 15 || res.Reconnect == nil || res.Reconnect.Complete != 15 {
		t.Fatalf("ramp %+v reconnect %+v: want 15 streams, each complete", res.Ramp, res.Reconnect)
	}
	if code == 0 || res.OK || !strings.Contains(res.Error, "only 15 of 20 streams opened") {
		t.Fatalf("exit %d, ok %v, error %q: 5 of the 20 streams never opened", code, res.OK, res.Error)
	}
}

// TestReconnectFailsOnReorderedReplays runs the reconnect storm with a
// server that replays the missed events newest first: out of order, with
// ordered publishers, is a fault in the storm as in fanout, not a figure
// to report beside a passing run.
func TestReconnectFailsOnReorderedReplays(t *testing.T) {
	hub := newFakeSSE()
	hub.reverseReplay = true
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.Header.Get("Last-Event-ID") != "" {
			time.Sleep(300 * time.Millisecond) // events are published meanwhile
		}
		hub.ServeHTTP(w, r)
	}))
	cfgFile, admin := fakeReload(t, base)
	args := append([]string{"reconnect", "-conns", "10", "-events", "20", "-rate", "40", "-channel-prefix", "ro",
		"-admin", admin, "-config", cfgFile, "-close-jitter", "1s"}, common(base)...)
	code, res, _ := runTool(t, args)
	if res.Delivery == nil || res.Delivery.Reordered == 0 || res.Delivery.Lost != 0 || res.Delivery.Dupes != 0 {
		t.Fatalf("delivery %+v: want events out of order, none lost or duplicated", res.Delivery)
	}
	if code == 0 || res.OK || !strings.Contains(res.Error, "out of order") {
		t.Fatalf("exit %d, ok %v, error %q: %d deliveries out of order", code, res.OK, res.Error, res.Delivery.Reordered)
	}
}
