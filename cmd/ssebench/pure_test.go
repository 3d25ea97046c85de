package main

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"net"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestHistogramBuckets(t *testing.T) {
	prevHi := int64(-1)
	for i := range histBuckets {
		lo, hi := histBounds(i)
		if lo != prevHi+1 || hi < lo {
			t.Fatalf("bucket %d = [%d, %d], previous ended at %d", i, lo, hi, prevHi)
		}
		if histIndex(lo) != i || histIndex(hi) != i {
			t.Fatalf("bucket %d = [%d, %d] but histIndex gives %d and %d", i, lo, hi, histIndex(lo), histIndex(hi))
		}
		if lo >= histLinear && float64(hi-lo)/float64(lo) > 1.0/histSub {
			t.Fatalf("bucket %d = [%d, %d] is wider than 1/%d", i, lo, hi, histSub)
		}
		prevHi = hi
		if hi == math.MaxInt64 {
			return
		}
	}
	t.Fatalf("buckets end at %d, want MaxInt64", prevHi)
}

// exactQuantile is the ceil(q·n)-th smallest value.
func exactQuantile(sorted []int64, q float64) int64 {
	rank := int(math.Ceil(q * float64(len(sorted))))
	return sorted[max(rank, 1)-1]
}

func TestHistogramQuantiles(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	gens := map[string]func() int64{
		"uniform ms":  func() int64 { return rng.Int64N(100_000_000) },
		"exponential": func() int64 { return int64(rng.ExpFloat64() * 5e6) },
		"lognormal":   func() int64 { return int64(math.Exp(rng.NormFloat64()*2 + 13)) },
		"small":       func() int64 { return rng.Int64N(300) },
	}
	for name, gen := range gens {
		t.Run(name, func(t *testing.T) {
			var a, b histogram
			var all []int64
			for i := range 100_000 {
				v := gen()
				all = append(all, v)
				if i%2 == 0 {
					a.Record(v)
				} else {
					b.Record(v)
				}
			}
			a.Merge(&b)
			slices.Sort(all)
			if a.Count() != uint64(len(all)) || a.Max() != all[len(all)-1] {
				t.Fatalf("count %d max %d, want %d %d", a.Count(), a.Max(), len(all), all[len(all)-1])
			}
			for _, q := range []float64{0, 0.01, 0.5, 0.9, 0.99, 0.999, 1} {
				got, want := a.Quantile(q), exactQuantile(all, q)
				if diff := math.Abs(float64(got - want)); diff > float64(want)/histSub+1 {
					t.Errorf("q%.3f = %d, exact %d (off by %.2f%%)", q, got, want, 100*diff/float64(want))
				}
			}
		})
	}
	var empty histogram
	if empty.Quantile(0.5) != 0 || empty.Summary().P99ms != 0 {
		t.Fatal("empty histogram is not zero")
	}
	var one histogram
	one.Record(-5)
	one.Record(1500_000)
	if s := one.Summary(); s.MaxMs != 1.5 || s.P50ms != 0 {
		t.Fatalf("summary %+v", s)
	}
}

func TestSeqSet(t *testing.T) {
	var s seqSet
	for _, seq := range []int64{1, 3, 2, 64, 63, 65, 1000} {
		if s.has(seq) {
			t.Fatalf("has(%d) before add", seq)
		}
		s.add(seq)
		if !s.has(seq) {
			t.Fatalf("!has(%d) after add", seq)
		}
	}
	for _, seq := range []int64{4, 62, 66, 999, 1001, 100000} {
		if s.has(seq) {
			t.Fatalf("has(%d), never added", seq)
		}
	}
	if s.max != 1000 {
		t.Fatalf("max %d", s.max)
	}
}

// TestClientAccounting feeds a client events in and out of order, twice,
// and from elsewhere, and checks what it counts.
func TestClientAccounting(t *testing.T) {
	tg := &target{raw: "http://127.0.0.1:1/e", url: mustURL(t, "http://127.0.0.1:1/e")}
	st := &stats{}
	c := newClient(0, tg, []int64{7, 9}, []string{"b7", "b9"}, false, 0, st)
	frame := func(ch, seq int64) string {
		return "event: tick\ndata: " + string(appendBenchData(nil, benchEvent{ch: ch, seq: seq, t: 1}, 0)) + "\nid: x\n\n"
	}
	in := frame(7, 1) + frame(7, 3) + frame(7, 2) + frame(7, 3) + frame(9, 1) + frame(8, 1) +
		"event: server_closing\ndata: {}\n\nevent: sse_truncated\ndata: {}\n\ndata: hello\n\n: hb\n"
	if err := c.feed([]byte(in), 10); err != nil {
		t.Fatal(err)
	}
	if c.uniq[0].Load() != 3 || c.uniq[1].Load() != 1 || st.dupes != 1 || st.reordered != 1 ||
		st.foreign != 1 || st.unparsed != 1 || st.closing != 1 || st.truncatedEvents != 1 || st.comments != 1 || st.received.Load() != 4 {
		t.Fatalf("uniq %d/%d, stats %+v", c.uniq[0].Load(), c.uniq[1].Load(), st)
	}
	// the duplicate, the event of another channel and the one without the
	// tool's data are neither received nor timed
	if st.lat.Count() != 4 || st.lat.Max() != 9 {
		t.Fatalf("latency n=%d max=%d", st.lat.Count(), st.lat.Max())
	}
	tl := countDelivered([]*client{c}, acceptedUpTo(0, 0, 0, 0, 0, 0, 0, 4, 0, 1))
	if tl.expected != 5 || tl.unique != 4 || tl.lost != 1 || tl.complete != 0 {
		t.Fatalf("tally %+v", tl)
	}
}

func mustURL(t *testing.T, s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func TestLoopback(t *testing.T) {
	for s, want := range map[string]bool{
		"127.0.0.1": true, "127.255.255.254": true, "::1": true, "::ffff:127.0.0.1": true,
		"0.0.0.0": false, "10.0.0.1": false, "128.0.0.1": false, "::": false, "fe80::1": false, "::ffff:10.0.0.1": false,
	} {
		if got := isLoopback(netip.MustParseAddr(s)); got != want {
			t.Errorf("isLoopback(%s) = %v", s, got)
		}
	}
	stub := func(ctx context.Context, host string) ([]netip.Addr, error) {
		switch host {
		case "localhost":
			return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")}, nil
		case "mixed":
			return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("192.0.2.1")}, nil
		case "none":
			return nil, nil
		}
		return nil, errors.New("no such host")
	}
	ctx := context.Background()
	for _, ok := range []string{"localhost", "127.0.0.1", "[::1]", "::1", "127.0.0.9"} {
		if _, err := checkLoopbackHost(ctx, ok, stub); err != nil {
			t.Errorf("%s refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "mixed", "none", "nowhere", "0.0.0.0", "192.0.2.1", "[2001:db8::1]"} {
		if _, err := checkLoopbackHost(ctx, bad, stub); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	for raw, ok := range map[string]bool{
		"http://localhost:9080/events":         true,
		"https://127.0.0.1/events?channels=a":  true,
		"http://[::1]:80/":                     true,
		"http://mixed:9080/":                   false,
		"ftp://127.0.0.1/":                     false,
		"http://192.0.2.1/events":              false,
		"http://user@192.0.2.1:80@127.0.0.1/x": true, // the host is what is dialled
	} {
		_, err := checkLoopbackURL(ctx, raw, stub)
		if (err == nil) != ok {
			t.Errorf("checkLoopbackURL(%q) = %v, want ok=%v", raw, err, ok)
		}
	}
	if err := checkLoopbackAddr(ctx, "127.0.0.1:2019", stub); err != nil {
		t.Error(err)
	}
	if err := checkLoopbackAddr(ctx, "192.0.2.1:2019", stub); err == nil {
		t.Error("non-loopback admin accepted")
	}
	// resolveTarget dials the checked address, never the name again
	tg, err := resolveTarget(ctx, "http://localhost:9080/events", stub)
	if err != nil || tg.addr.String() != "127.0.0.1:9080" || tg.host != "localhost:9080" {
		t.Fatalf("resolveTarget: %+v %v", tg, err)
	}
}

func TestSourceRange(t *testing.T) {
	got, err := parseSourceRange("127.0.0.2-127.0.1.1")
	if err != nil || len(got) != 256 || got[0].String() != "127.0.0.2" || got[255].String() != "127.0.1.1" {
		t.Fatalf("got %d addresses (%v), %v", len(got), got[:1], err)
	}
	if got, err := parseSourceRange("127.0.0.5"); err != nil || len(got) != 1 {
		t.Fatalf("single: %v %v", got, err)
	}
	for _, bad := range []string{"10.0.0.1-10.0.0.5", "127.0.0.5-127.0.0.2", "::1", "x"} {
		if _, err := parseSourceRange(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestRequestURI(t *testing.T) {
	ctx := context.Background()
	tg, _ := resolveTarget(ctx, "http://127.0.0.1:1/events", defaultLookup)
	if got := tg.requestURI([]string{"a", "b"}); got != "/events?channels=a%2Cb" {
		t.Errorf("got %q", got)
	}
	tg, _ = resolveTarget(ctx, "http://127.0.0.1:1/events?x=1", defaultLookup)
	if got := tg.requestURI([]string{"a"}); got != "/events?x=1&channels=a" {
		t.Errorf("got %q", got)
	}
	tg, _ = resolveTarget(ctx, "http://127.0.0.1:1/sse/{ch}?t=1", defaultLookup)
	if got := tg.requestURI([]string{"a"}); got != "/sse/a?t=1" {
		t.Errorf("got %q", got)
	}
}

func TestParseProc(t *testing.T) {
	stat := "4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 75 0 0 20 0 17 0 123456 1234567890 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"
	s, err := parseProcStat([]byte(stat))
	if err != nil || s.utimeTicks != 250 || s.stimeTicks != 75 || s.threads != 17 || s.rssPages != 2048 || s.cpuSeconds() != 3.25 || s.userSeconds() != 2.5 {
		t.Fatalf("parseProcStat: %+v %v", s, err)
	}
	// cutime 30, cstime 5: the reaped children's CPU counts in
	reaped := strings.Replace(stat, " 250 75 0 0 ", " 250 75 30 5 ", 1)
	if s, err := parseProcStat([]byte(reaped)); err != nil || s.state != 'S' || s.cpuSeconds() != 3.6 || s.userSeconds() != 2.8 {
		t.Fatalf("parseProcStat with reaped children: %+v %v", s, err)
	}
	if _, err := parseProcStat([]byte("1 (x) S 1 2")); err == nil {
		t.Fatal("short stat accepted")
	}
	status := "Name:\tcaddy\nVmHWM:\t  460000 kB\nVmRSS:\t  452664 kB\nThreads:\t9\n"
	st, err := parseProcStatus([]byte(status))
	if err != nil || st.rssKiB != 452664 || st.hwmKiB != 460000 || st.threads != 9 {
		t.Fatalf("parseProcStatus: %+v %v", st, err)
	}
	if _, err := parseProcStatus([]byte("Name:\tkthreadd\n")); err == nil {
		t.Fatal("status without VmRSS accepted")
	}
	tcp := `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:2378 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 81234 1 0000000000000000 100 0 0 10 0
   1: 0100007F:2378 0200007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 99999 1 0000000000000000 20 4 30 10 -1
   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5555 1 0000000000000000 100 0 0 10 0
`
	inodes, err := listenInodes([]byte(tcp), 9080)
	if err != nil || !slices.Equal(inodes, []uint64{81234}) {
		t.Fatalf("listenInodes(9080) = %v, %v", inodes, err)
	}
	if inodes, _ := listenInodes([]byte(tcp), 8080); !slices.Equal(inodes, []uint64{5555}) {
		t.Fatalf("listenInodes(8080) = %v", inodes)
	}
	if n, ok := parseSocketLink("socket:[81234]"); !ok || n != 81234 {
		t.Fatal("parseSocketLink")
	}
	if _, ok := parseSocketLink("pipe:[1]"); ok {
		t.Fatal("pipe parsed as a socket")
	}
}

func TestParseCPUTimes(t *testing.T) {
	stat := "cpu  100 5 50 9000 7 3 2 1 0 0\ncpu0 50 2 25 4500 3 1 1 0 0 0\n"
	got, err := parseCPUTimes([]byte(stat))
	if err != nil || got.busy != 1.60 || got.steal != 0.01 {
		t.Fatalf("parseCPUTimes = %+v, %v; want busy 1.60 (user, nice, system, irq, softirq), steal 0.01", got, err)
	}
	if _, err := parseCPUTimes([]byte("intr 1 2 3\n")); err == nil {
		t.Fatal("no cpu line accepted")
	}
	if v, ok := machineCPU(); !ok || v.busy <= 0 {
		t.Fatalf("machineCPU = %+v %v", v, ok)
	}
}

func TestProcLive(t *testing.T) {
	me, err := readProc(os.Getpid())
	if err != nil || me.rssKiB <= 0 || me.threads <= 0 || me.fds <= 0 {
		t.Fatalf("readProc(self) = %+v, %v", me, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	pids, err := listenerHolders(port, false)
	if err != nil || !slices.Equal(pids, []int{os.Getpid()}) {
		t.Fatalf("listenerHolders(%d) = %v, %v; want %d", port, pids, err, os.Getpid())
	}
	if _, err := findListenerPIDs(port); err == nil || !strings.Contains(err.Error(), "no readable process") {
		t.Fatalf("findListenerPIDs skips this process: %v", err)
	}
}

// TestHistogramJSON checks that a histogram survives the wire (a worker's
// report) exactly, so merged percentiles are those of one histogram.
func TestHistogramJSON(t *testing.T) {
	var a, b, all histogram
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 20000 {
		v := int64(rng.ExpFloat64() * 5e6)
		if i%2 == 0 {
			a.Record(v)
		} else {
			b.Record(v)
		}
		all.Record(v)
	}
	var merged histogram
	for _, h := range []*histogram{&a, &b, {}} {
		j, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		var back histogram
		if err := json.Unmarshal(j, &back); err != nil {
			t.Fatal(err)
		}
		if back != *h {
			t.Fatalf("round trip changed the histogram (%s)", j[:min(len(j), 80)])
		}
		merged.Merge(&back)
	}
	if merged.counts != all.counts || merged.n != all.n || merged.min != all.min || merged.max != all.max {
		t.Fatal("merged histogram differs from the one of every value")
	}
	for _, q := range []float64{0.5, 0.99, 0.999} {
		if merged.Quantile(q) != all.Quantile(q) {
			t.Fatalf("q%v: %d != %d", q, merged.Quantile(q), all.Quantile(q))
		}
	}
	var h histogram
	for _, bad := range []string{`{"n":1,"b":[[99999999,1]]}`, `{"n":2,"b":[[1,1]]}`} {
		if err := json.Unmarshal([]byte(bad), &h); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestSplitSpawn(t *testing.T) {
	env, args := splitSpawn("SSEBENCH_PORT=9180 SSEBENCH_ADMIN=9119  /tmp/bench-caddy run --config a=b")
	if !slices.Equal(env, []string{"SSEBENCH_PORT=9180", "SSEBENCH_ADMIN=9119"}) || !slices.Equal(args, []string{"/tmp/bench-caddy", "run", "--config", "a=b"}) {
		t.Fatalf("env %q args %q", env, args)
	}
	env, args = splitSpawn("/tmp/bench-caddy run")
	if len(env) != 0 || len(args) != 2 {
		t.Fatalf("env %q args %q", env, args)
	}
}

// TestCountWire checks the parent's loss count over workers' tallies
// against countDelivered over the same clients.
func TestCountWire(t *testing.T) {
	k := newCore(engineOpts{}, 1)
	tgt := &target{raw: "http://127.0.0.1/x", url: mustURL(t, "http://127.0.0.1/x")}
	var clients []*client
	for i := range 30 {
		c := newClient(i, tgt, []int64{int64(i % 3), int64((i + 1) % 3)}, []string{"a", "b"}, false, 0, k.shards[0])
		c.uniq[0].Store(int64(i % 5))
		c.uniq[1].Store(int64(i % 7))
		clients = append(clients, c)
	}
	acc := acceptedUpTo(4, 5, 6)
	want := countDelivered(clients, acc)
	got := countWire([]*workerTally{workerTallyOf(clients[:10], 3, k, acc), workerTallyOf(clients[10:], 3, k, acc)}, acc)
	want.complete = 0
	if got != want {
		t.Fatalf("countWire %+v, countDelivered %+v", got, want)
	}
}

func TestParseArgsRedisProcs(t *testing.T) {
	cfg, err := parseArgs([]string{"scaleout", "-url", "http://127.0.0.1:1/e,http://127.0.0.1:2/e", "-procs", "3", "-conns", "30",
		"-spawn", "A=1 x", "-spawn", "A=2 x", "-admin", "127.0.0.1:3, 127.0.0.1:4", "-spawn-redis", "redis-server", "-publish-redis", "spawned"})
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.spawns) != 2 || cfg.admin != "127.0.0.1:3" || !slices.Equal(cfg.admins, []string{"127.0.0.1:3", "127.0.0.1:4"}) || cfg.procs != 3 {
		t.Fatalf("%+v", cfg)
	}
	for _, args := range [][]string{
		{"idle", "-procs", "2"},
		{"fanout", "-procs", "5", "-conns", "4"},
		{"fanout", "-spawn-redis", "redis-server", "-redis-port", "6379"},
		{"fanout", "-redis-port", "7000"},
		{"fanout", "-publish-redis", "spawned"},
		{"fanout", "-spawn", ""},
	} {
		if _, err := parseArgs(append(args, "-q")); err == nil {
			t.Errorf("parseArgs(%q) accepted", args)
		}
	}
}
