package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/netip"

	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// result is the JSON line of a run.
type result struct {
	Scenario  string            `json:"scenario"`
	Label     string            `json:"label,omitempty"`
	Started   string            `json:"started"`
	OK        bool              `json:"ok"`
	Error     string            `json:"error,omitempty"`
	Engine    string            `json:"engine"`
	Proto     string            `json:"proto"`
	Targets   []string          `json:"targets"`
	PublishTo string            `json:"publish_url,omitempty"`
	Conns     int               `json:"conns"`
	Channels  int               `json:"channels"`
	PerConn   int               `json:"per_conn"`
	Rate      float64           `json:"rate,omitempty"`
	DurationS float64           `json:"duration_s,omitempty"`
	Workers   int               `json:"workers,omitempty"`
	Procs     int               `json:"procs,omitempty"`
	LoadStart string            `json:"loadavg_start"`
	LoadEnd   string            `json:"loadavg_end"`
	ElapsedS  float64           `json:"elapsed_s"`
	Ramp      *rampSummary      `json:"ramp,omitempty"`
	Server    *serverSummary    `json:"server,omitempty"`
	Redis     *redisSummary     `json:"redis,omitempty"`
	Client    *clientSummary    `json:"client,omitempty"`
	Delivery  *deliverySummary  `json:"delivery,omitempty"`
	Latency   *latencySummary   `json:"latency,omitempty"`
	Publish   *publishSummary   `json:"publish,omitempty"`
	Reconnect *reconnectSummary `json:"reconnect,omitempty"`
	Churn     *churnSummary     `json:"churn,omitempty"`
	Conn      *connSummary      `json:"connections,omitempty"`
	Box       *boxSummary       `json:"box,omitempty"`
	Errors    map[string]int64  `json:"errors,omitempty"`
	Notes     []string          `json:"notes,omitempty"`
}

// boxSummary is the machine's CPU over the measured window: what the server
// and this tool used, and what other processes took (a contended run).
type boxSummary struct {
	Seconds     float64 `json:"seconds"`
	BusyCores   float64 `json:"busy_cores"`
	ServerCores float64 `json:"server_cores"`
	RedisCores  float64 `json:"redis_cores,omitempty"`
	ClientCores float64 `json:"client_cores"`
	// SoftirqCores is the kernel's softirq threads: network work of the
	// measured traffic that the kernel deferred (not counted in others).
	SoftirqCores float64 `json:"softirq_cores"`
	OtherCores   float64 `json:"other_cores"`
	Cores        int     `json:"cores"`
}

// boxWindow starts measuring the machine's CPU; end records the window.
func (r *runner) boxWindow() (end func()) {
	busy0, ok := machineBusy()
	srv0, _ := r.sample()
	self0 := r.clientCPU()
	soft0 := softirqCPU()
	t0 := time.Now()
	return func() {
		busy1, ok1 := machineBusy()
		if !ok || !ok1 {
			return
		}
		srv1, _ := r.sample()
		secs := time.Since(t0).Seconds()
		if secs <= 0 {
			return
		}
		b := &boxSummary{
			Seconds:     round3(secs),
			BusyCores:   round3((busy1 - busy0) / secs),
			ServerCores: round3((srv1.cpuSec - srv0.cpuSec) / secs),
			RedisCores:  round3((srv1.redisCPU() - srv0.redisCPU()) / secs),
			ClientCores: round3((r.clientCPU() - self0) / secs),
			Cores:       runtime.NumCPU(),
		}
		b.SoftirqCores = round3((softirqCPU() - soft0) / secs)
		b.OtherCores = round3(max(0, b.BusyCores-b.ServerCores-b.RedisCores-b.ClientCores-b.SoftirqCores))
		r.res.Box = b
		if b.OtherCores > r.cfg.quietCores {
			r.note(fmt.Sprintf("contended: other processes used %.2f cores during the measurement", b.OtherCores))
		}
	}
}

// waitQuiet waits (at most -quiet-wait) until the other processes of the
// machine use less than -quiet-cores, so that figures are not contended.
func (r *runner) waitQuiet() {
	if r.cfg.quietWait <= 0 {
		return
	}
	setPhase("wait-quiet")
	deadline := time.Now().Add(r.cfg.quietWait)
	for {
		busy0, ok := machineBusy()
		srv0, _ := r.sample()
		self0 := r.clientCPU()
		time.Sleep(2 * time.Second)
		busy1, ok1 := machineBusy()
		srv1, _ := r.sample()
		if !ok || !ok1 {
			return
		}
		others := (busy1 - busy0 - (srv1.cpuSec - srv0.cpuSec) - (srv1.redisCPU() - srv0.redisCPU()) - (r.clientCPU() - self0)) / 2
		if others < r.cfg.quietCores {
			return
		}
		if time.Now().After(deadline) {
			r.note(fmt.Sprintf("the machine was still busy (%.2f cores used by others) after -quiet-wait %s", others, r.cfg.quietWait))
			return
		}
		if !r.cfg.quiet {
			fmt.Fprintf(r.stderr, "ssebench: waiting for a quiet machine (others use %.2f cores)\n", others)
		}
	}
}

type rampSummary struct {
	Conns          int             `json:"conns"`
	Connected      int64           `json:"connected"`
	Failed         int64           `json:"failed_attempts"`
	GaveUp         int64           `json:"gave_up"`
	Seconds        float64         `json:"seconds"`
	ConnsPerS      float64         `json:"conns_per_s"`
	TimedOut       bool            `json:"timed_out,omitempty"`
	ConnectLatency *latencySummary `json:"connect_latency"`
	ServerCPUs     float64         `json:"server_cpu_s,omitempty"`
	ServerCPUPerUs float64         `json:"server_cpu_per_conn_us,omitempty"`
	ClientCPUs     float64         `json:"client_cpu_s"`
}

type serverSummary struct {
	PID              int     `json:"pid"`
	PIDs             []int   `json:"pids,omitempty"` // several servers: the figures below are sums
	RSSBaseKiB       int64   `json:"rss_base_kib"`
	RSSKiB           int64   `json:"rss_kib"`
	HWMKiB           int64   `json:"rss_peak_kib"`
	RSSPerConnKiB    float64 `json:"rss_per_conn_kib,omitempty"`
	CPUSeconds       float64 `json:"cpu_s"`
	CPUCores         float64 `json:"cpu_cores"`
	CPUPerDeliveryUs float64 `json:"cpu_per_delivery_us,omitempty"`
	Threads          int64   `json:"threads"`
	FDs              int     `json:"fds"`
	FDsBase          int     `json:"fds_base"`
	Goroutines       int     `json:"goroutines,omitempty"`
	// MemStats is the Go runtime's view (admin /debug/vars), in KiB.
	MemStats *memStats `json:"memstats_kib,omitempty"`
	// Processes are the servers one by one, when there are several.
	Processes []procSummary `json:"processes,omitempty"`
}

// procSummary is one process: a server, the Redis, or a subscriber worker.
type procSummary struct {
	PID        int     `json:"pid"`
	URL        string  `json:"url,omitempty"`
	Conns      int     `json:"conns,omitempty"`
	RSSBaseKiB int64   `json:"rss_base_kib,omitempty"`
	RSSKiB     int64   `json:"rss_kib"`
	HWMKiB     int64   `json:"rss_peak_kib"`
	CPUSeconds float64 `json:"cpu_s"`
	CPUCores   float64 `json:"cpu_cores,omitempty"`
	Threads    int64   `json:"threads,omitempty"`
	FDs        int     `json:"fds,omitempty"`
}

// redisSummary is the spawned redis-server over the measured window.
type redisSummary struct {
	URL string `json:"url"`
	procSummary
}

// memStats is the part of runtime.MemStats that explains an RSS, in KiB.
type memStats struct {
	HeapAlloc    int64   `json:"heap_alloc"`
	HeapInuse    int64   `json:"heap_inuse"`
	HeapIdle     int64   `json:"heap_idle_unreleased"`
	StackInuse   int64   `json:"stack_inuse"`
	MSpanInuse   int64   `json:"mspan_inuse"`
	GCSys        int64   `json:"gc_sys"`
	OtherSys     int64   `json:"other_sys"`
	Sys          int64   `json:"sys"`
	NumGC        int64   `json:"num_gc"`
	PerConnStack float64 `json:"stack_per_conn,omitempty"`
	PerConnHeap  float64 `json:"heap_inuse_per_conn,omitempty"`
}

// serverMemStats reads runtime.MemStats from the admin's /debug/vars, summed
// over every -admin (nil if one does not answer).
func (r *runner) serverMemStats() *memStats {
	var sum *memStats
	for _, a := range r.cfg.admins {
		m := adminMemStats(a)
		if m == nil {
			return nil
		}
		if sum == nil {
			sum = m
			continue
		}
		sum.HeapAlloc += m.HeapAlloc
		sum.HeapInuse += m.HeapInuse
		sum.HeapIdle += m.HeapIdle
		sum.StackInuse += m.StackInuse
		sum.MSpanInuse += m.MSpanInuse
		sum.GCSys += m.GCSys
		sum.OtherSys += m.OtherSys
		sum.Sys += m.Sys
		sum.NumGC += m.NumGC
	}
	return sum
}

func adminMemStats(admin string) *memStats {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	hc, err := adminClient(ctx, admin)
	if err != nil {
		return nil
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/vars", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var v struct {
		MemStats struct {
			HeapAlloc, HeapInuse, HeapIdle, HeapReleased, StackInuse, MSpanInuse, GCSys, OtherSys, Sys int64
			NumGC                                                                                      int64
		} `json:"memstats"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return nil
	}
	m := v.MemStats
	k := func(b int64) int64 { return b >> 10 }
	return &memStats{
		HeapAlloc: k(m.HeapAlloc), HeapInuse: k(m.HeapInuse), HeapIdle: k(m.HeapIdle - m.HeapReleased),
		StackInuse: k(m.StackInuse), MSpanInuse: k(m.MSpanInuse), GCSys: k(m.GCSys), OtherSys: k(m.OtherSys),
		Sys: k(m.Sys), NumGC: m.NumGC,
	}
}

type clientSummary struct {
	CPUSeconds       float64 `json:"cpu_s"`
	CPUCores         float64 `json:"cpu_cores"`
	CPUPerDeliveryUs float64 `json:"cpu_per_delivery_us,omitempty"`
	RSSKiB           int64   `json:"rss_kib"`
	Goroutines       int     `json:"goroutines"`
	// Procs are the subscriber workers (-procs; their CPU since they
	// started); the figures above include them.
	Procs []procSummary `json:"procs,omitempty"`
}

type deliverySummary struct {
	Clients      int     `json:"clients"`
	Expected     int64   `json:"expected"`
	Unique       int64   `json:"unique"`
	Received     int64   `json:"received"`
	Lost         int64   `json:"lost"`
	Dupes        int64   `json:"dupes"`
	Reordered    int64   `json:"reordered"`
	Extra        int64   `json:"extra,omitempty"`
	Foreign      int64   `json:"foreign,omitempty"`
	Truncated    int64   `json:"truncated_events,omitempty"`
	Closing      int64   `json:"server_closing,omitempty"`
	PerS         float64 `json:"per_s"`
	OverallPerS  float64 `json:"overall_per_s"`
	DrainSeconds float64 `json:"drain_s"`
	Drained      bool    `json:"drained"`
}

type reconnectSummary struct {
	Reload           string  `json:"reload"`
	ReloadSeconds    float64 `json:"reload_s"`
	AllReconnectedS  float64 `json:"all_reconnected_s"`
	AllEventsS       float64 `json:"all_events_s"`
	DoneS            float64 `json:"done_s"`
	BudgetS          float64 `json:"budget_s"`
	WithinBudget     bool    `json:"within_budget"`
	Clients          int     `json:"clients"`
	Reconnected      int     `json:"clients_reconnected"`
	Complete         int     `json:"clients_complete"`
	ServerClosing    int64   `json:"server_closing_events"`
	TruncatedReplays int64   `json:"truncated"`
}

type churnSummary struct {
	Scheduled       int64           `json:"scheduled"`
	Attempted       int64           `json:"attempted"`
	Connected       int64           `json:"connected"`
	Failed          int64           `json:"failed"`
	SkippedFDLimit  int64           `json:"skipped_fd_limit,omitempty"`
	Seconds         float64         `json:"seconds"`
	ConnsPerS       float64         `json:"conns_per_s"`
	PeakLive        int64           `json:"peak_live"`
	ConnectLatency  *latencySummary `json:"connect_latency"`
	ServerCPUPerCon float64         `json:"server_cpu_per_conn_us"`
}

type connSummary struct {
	Attempts      int64 `json:"attempts"`
	Connected     int64 `json:"connected"`
	Failed        int64 `json:"failed"`
	GaveUp        int64 `json:"gave_up"`
	Ended         int64 `json:"ended_by_server"`
	ClosedByUs    int64 `json:"closed_by_us"`
	Reconnects    int64 `json:"reconnects"`
	TruncatedHead int64 `json:"truncated_heads"`
	Dials         int64 `json:"dials,omitempty"`
	EpollWaits    int64 `json:"epoll_waits,omitempty"`
	ReadyEvents   int64 `json:"ready_events,omitempty"`
	Reads         int64 `json:"reads,omitempty"`
}

func newResult(cfg *config) *result {
	return &result{
		Scenario:  cfg.scenario,
		Label:     cfg.label,
		Started:   time.Now().UTC().Format(time.RFC3339),
		Proto:     cfg.proto,
		Conns:     cfg.conns,
		Channels:  cfg.channels,
		PerConn:   cfg.perConn,
		Rate:      cfg.rate,
		DurationS: cfg.duration.Seconds(),
		Procs:     cfg.procs,
		LoadStart: loadavg(),
	}
}

// runner runs one scenario.
type runner struct {
	cfg       *config
	res       *result
	targets   []*target
	pubTarget *target
	names     []string
	eng       engine
	clients   []*client
	pid       int   // the (first) server
	pids      []int // every spawned server
	redisURL  string
	redisDir  string
	redisOpts *redis.Options // -publish-redis

	serverLogPaths []string
	redisLogPath   string

	stdout io.Writer // the JSON line
	stderr io.Writer // the summary and progress

	mu      sync.Mutex
	servers []*proc // spawned servers
	redis   *proc   // spawned redis-server
	workers []*workerProc
	began   time.Time
}

func newRunner(cfg *config, stdout, stderr io.Writer) *runner {
	return &runner{cfg: cfg, res: newResult(cfg), stdout: stdout, stderr: stderr}
}

func (r *runner) run() int {
	r.began = time.Now()
	err := r.setup()
	if err == nil {
		r.waitQuiet()
		stop := r.progress()
		switch r.cfg.scenario {
		case "idle":
			err = r.idle()
		case "fanout", "spread", "scaleout":
			var ss streamSet = &localStreams{r: r}
			if r.cfg.procs > 0 {
				ss = &workerStreams{r: r}
			}
			err = r.deliver(ss)
		case "reconnect":
			err = r.reconnectStorm()
		case "churn":
			err = r.churn()
		}
		stop()
	}
	setPhase("teardown")
	if r.eng != nil {
		if cerr := r.eng.closeAll(15 * time.Second); cerr != nil {
			r.note(cerr.Error())
		}
		k := r.eng.core()
		r.res.Conn = connSummaryOf(k)
		if errs := k.errors(); len(errs) > 0 {
			r.res.Errors = errs
		}
	}
	r.stopWorkers()
	r.stopServer()
	r.res.LoadEnd = loadavg()
	r.res.ElapsedS = round3(time.Since(r.began).Seconds())
	if err != nil {
		r.res.Error = err.Error()
	}
	r.res.OK = err == nil
	line, _ := json.Marshal(r.res)
	fmt.Fprintln(r.stdout, string(line))
	r.appendOut(line)
	r.printSummary()
	if err != nil {
		fmt.Fprintln(r.stderr, "ssebench:", err)
		return 1
	}
	return 0
}

func (r *runner) note(s string) { r.res.Notes = append(r.res.Notes, s) }

func (r *runner) appendOut(line []byte) {
	if r.cfg.out == "" {
		return
	}
	f, err := os.OpenFile(r.cfg.out, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(r.stderr, "ssebench:", err)
		return
	}
	defer f.Close()
	_, _ = f.Write(append(line, '\n'))
}

// resolveTarget checks that raw is a loopback URL and resolves it.
func resolveTarget(ctx context.Context, raw string, lookup lookupFunc) (*target, error) {
	u, err := checkLoopbackURL(ctx, strings.ReplaceAll(raw, "{ch}", "x"), lookup)
	if err != nil {
		return nil, err
	}
	addrs, err := checkLoopbackHost(ctx, u.Hostname(), lookup)
	if err != nil {
		return nil, err
	}
	addr := addrs[0]
	for _, a := range addrs {
		if a.Unmap().Is4() {
			addr = a.Unmap()
			break
		}
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("url %q: port %q", raw, port)
	}
	return &target{raw: raw, url: u, addr: netip.AddrPortFrom(addr, uint16(p)), host: u.Host, tls: u.Scheme == "https"}, nil
}

func (r *runner) setup() error {
	cfg := r.cfg
	// for resolving and checking the addresses; the spawn and the Redis
	// check after it have their own limits
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, raw := range cfg.urls {
		t, err := resolveTarget(ctx, raw, defaultLookup)
		if err != nil {
			return err
		}
		t.index = i
		r.targets = append(r.targets, t)
		r.res.Targets = append(r.res.Targets, raw)
	}
	pubRaw := cfg.publishURL
	if pubRaw == "" {
		u := *r.targets[0].url
		u.RawQuery = ""
		pubRaw = u.String()
	}
	pt, err := resolveTarget(ctx, pubRaw, defaultLookup)
	if err != nil {
		return err
	}
	r.pubTarget = pt
	r.res.PublishTo = pubRaw
	for _, a := range cfg.admins {
		if err := checkLoopbackAddr(ctx, a, defaultLookup); err != nil {
			return fmt.Errorf("-admin: %v", err)
		}
	}
	if cfg.publishRedis != "" && cfg.publishRedis != "spawned" {
		if r.redisOpts, err = parseRedisURL(ctx, cfg.publishRedis); err != nil {
			return fmt.Errorf("-publish-redis: %v", err)
		}
	}
	srcs, err := parseSourceRange(cfg.src)
	if err != nil {
		return err
	}
	for i := range cfg.channels {
		r.names = append(r.names, cfg.channelPrefix+strconv.Itoa(i))
	}
	anyTLS := false
	for _, t := range r.targets {
		anyTLS = anyTLS || t.tls
	}
	if anyTLS && cfg.engine == "epoll" {
		if cfg.set["engine"] {
			return errors.New("https targets need -engine std (the epoll engine speaks HTTP/1.1 cleartext only)")
		}
		cfg.engine = "std"
		r.note("https target: using the std engine")
	}
	if cfg.proto == "h2" && !anyTLS {
		return errors.New("-proto h2 needs https targets (h2c is not supported)")
	}
	if err := r.spawn(); err != nil {
		return err
	}
	if cfg.publishRedis != "" {
		if err := r.setupRedisPublish(); err != nil {
			return err
		}
	}
	switch {
	case r.pid != 0, cfg.scenario == workerCommand:
	case cfg.pid != 0:
		r.pid = cfg.pid
	default:
		pid, err := findListenerPID(int(r.targets[0].addr.Port()))
		if err != nil {
			r.note("server metrics unavailable: " + err.Error())
		}
		r.pid = pid
	}
	if cfg.procs > 0 { // the workers open the streams
		r.res.Engine = cfg.engine
		if cfg.engine == "epoll" {
			r.res.Workers = cfg.workers
		}
		return nil
	}
	opts := engineOpts{
		srcs:         srcs,
		headTimeout:  cfg.headTimeout,
		defaultRetry: cfg.defaultRetry,
		workers:      cfg.workers,
		proto:        cfg.proto,
		h2Conns:      cfg.h2Conns,
		readBuf:      cfg.readBuf,
		uring:        cfg.uring,
	}
	if cfg.engine == "epoll" {
		r.eng, err = openEpollEngine(opts)
	} else {
		r.eng, err = newStdEngine(opts, r.targets)
	}
	if err != nil {
		return err
	}
	r.res.Engine = r.eng.name()
	if cfg.engine == "epoll" {
		r.res.Workers = cfg.workers
	}
	return nil
}

// sample reads the server (the sum over several spawned servers, each in
// per) and the spawned Redis (in redis).
func (r *runner) sample() (procSample, bool) {
	pids := r.pids
	if len(pids) == 0 && r.pid != 0 {
		pids = []int{r.pid}
	}
	var sum procSample
	r.mu.Lock()
	rds := r.redis
	r.mu.Unlock()
	if rds != nil {
		if s, err := readProc(rds.pid()); err == nil {
			sum.redis = &s
		}
	}
	if len(pids) == 0 {
		return sum, false
	}
	for _, pid := range pids {
		s, err := readProc(pid)
		if err != nil {
			r.note(fmt.Sprintf("reading /proc/%d: %v", pid, err))
			return sum, false
		}
		sum.rssKiB += s.rssKiB
		sum.hwmKiB += s.hwmKiB
		sum.cpuSec += s.cpuSec
		sum.threads += s.threads
		sum.fds += s.fds
		if len(pids) > 1 {
			sum.per = append(sum.per, s)
		}
	}
	return sum, true
}

func selfCPU() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

func (r *runner) clientSummary(cpu0, cpu1 float64, secs float64, deliveries int64) *clientSummary {
	s := &clientSummary{CPUSeconds: round3(cpu1 - cpu0), Goroutines: runtime.NumGoroutine()}
	if secs > 0 {
		s.CPUCores = round3((cpu1 - cpu0) / secs)
	}
	if deliveries > 0 {
		s.CPUPerDeliveryUs = round3((cpu1 - cpu0) / float64(deliveries) * 1e6)
	}
	if me, err := readProc(os.Getpid()); err == nil {
		s.RSSKiB = me.rssKiB
	}
	s.Procs = r.workerSummaries()
	for _, w := range s.Procs {
		s.RSSKiB += w.RSSKiB
	}
	return s
}

// serverSummary is the server(s) from base (before connecting) and over
// the window before→after; it also fills in the spawned Redis.
func (r *runner) serverSummary(base, before, after procSample, secs float64, deliveries int64) *serverSummary {
	s := &serverSummary{
		PID: r.pid, RSSBaseKiB: base.rssKiB, RSSKiB: after.rssKiB, HWMKiB: after.hwmKiB,
		CPUSeconds: round3(after.cpuSec - before.cpuSec), Threads: after.threads, FDs: after.fds, FDsBase: base.fds,
	}
	if secs > 0 {
		s.CPUCores = round3((after.cpuSec - before.cpuSec) / secs)
	}
	if deliveries > 0 {
		s.CPUPerDeliveryUs = round3((after.cpuSec - before.cpuSec) / float64(deliveries) * 1e6)
	}
	s.Goroutines = r.serverGoroutines()
	if len(after.per) > 1 && len(after.per) == len(before.per) && len(after.per) == len(base.per) {
		s.PIDs = r.pids
		for i, a := range after.per {
			s.Processes = append(s.Processes, procDelta(r.pids[i], base.per[i], before.per[i], a, secs))
		}
	}
	if after.redis != nil && before.redis != nil && base.redis != nil {
		r.mu.Lock()
		rds := r.redis
		r.mu.Unlock()
		pid := 0
		if rds != nil {
			pid = rds.pid()
		}
		r.res.Redis = &redisSummary{URL: r.redisURL, procSummary: procDelta(pid, *base.redis, *before.redis, *after.redis, secs)}
	}
	return s
}

func procDelta(pid int, base, before, after procSample, secs float64) procSummary {
	p := procSummary{
		PID: pid, RSSBaseKiB: base.rssKiB, RSSKiB: after.rssKiB, HWMKiB: after.hwmKiB,
		CPUSeconds: round3(after.cpuSec - before.cpuSec), Threads: after.threads, FDs: after.fds,
	}
	if secs > 0 {
		p.CPUCores = round3((after.cpuSec - before.cpuSec) / secs)
	}
	return p
}

// progress prints a status line every 2 s on stderr until stopped.
func (r *runner) progress() (stop func()) {
	if r.cfg.quiet {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			p, _ := phase.Load().(string)
			line := fmt.Sprintf("ssebench: %6.1fs %-10s ", time.Since(r.began).Seconds(), p)
			if r.eng != nil {
				k := r.eng.core()
				line += fmt.Sprintf("live %d connected %d failed %d received %d",
					k.cnt.live.Load(), k.cnt.connected.Load(), k.cnt.failed.Load(), k.received())
			} else {
				line += r.workerProgressLine()
			}
			s, ok := r.sample()
			if ok {
				line += fmt.Sprintf(" | server rss %d MiB cpu %.1fs", s.rssKiB>>10, s.cpuSec)
				if len(s.per) > 1 {
					line += fmt.Sprintf(" (%d processes)", len(s.per))
				}
			}
			if s.redis != nil {
				line += fmt.Sprintf(" | redis rss %d MiB cpu %.1fs", s.redis.rssKiB>>10, s.redis.cpuSec)
			}
			fmt.Fprintln(r.stderr, line)
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

func (r *runner) newClient(id int, reconnect bool, hold time.Duration) *client {
	cfg := r.cfg
	t := r.targets[id%len(r.targets)]
	chans := make([]int64, cfg.perConn)
	names := make([]string, cfg.perConn)
	for j := range cfg.perConn {
		ch := (id*cfg.perConn + j) % cfg.channels
		chans[j] = int64(ch)
		names[j] = r.names[ch]
	}
	return newClient(id, t, chans, names, reconnect, hold, r.eng.shardFor(id))
}

// ramp opens cfg.conns streams, at most cfg.inflight attempts at a time,
// and waits until each is open or has given up, or the ramp time limit.
func (r *runner) ramp() *rampSummary {
	setPhase("ramp")
	cfg := r.cfg
	k := r.eng.core()
	before, haveServer := r.sample()
	cpu0 := selfCPU()
	start := time.Now()
	deadline := start.Add(cfg.rampTimeout)
	timedOut := false
	settled := func() int64 { return k.cnt.firstConnected.Load() + k.cnt.gaveUp.Load() }
open:
	for i := range cfg.conns {
		for int64(i)-settled() >= int64(cfg.inflight) {
			if time.Now().After(deadline) {
				timedOut = true
				break open
			}
			time.Sleep(100 * time.Microsecond)
		}
		c := r.newClient(cfg.idBase+i, cfg.reconnect, 0)
		r.clients = append(r.clients, c)
		r.eng.start(c)
	}
	for !timedOut && settled() < int64(len(r.clients)) {
		if time.Now().After(deadline) {
			timedOut = true
			break
		}
		time.Sleep(500 * time.Microsecond)
	}
	secs := time.Since(start).Seconds()
	t := k.totals()
	s := &rampSummary{
		Conns: cfg.conns, Connected: k.cnt.firstConnected.Load(), Failed: k.cnt.failed.Load(), GaveUp: k.cnt.gaveUp.Load(),
		Seconds: round3(secs), TimedOut: timedOut, ConnectLatency: t.connLat.Summary(),
	}
	if secs > 0 {
		s.ConnsPerS = math.Round(float64(s.Connected) / secs)
	}
	s.ClientCPUs = round3(selfCPU() - cpu0)
	if after, ok := r.sample(); ok && haveServer {
		s.ServerCPUs = round3(after.cpuSec - before.cpuSec)
		if s.Connected > 0 {
			s.ServerCPUPerUs = round3(s.ServerCPUs / float64(s.Connected) * 1e6)
		}
	}
	r.res.Ramp = s
	return s
}

func sleepPhase(name string, d time.Duration) {
	if d > 0 {
		setPhase(name)
		time.Sleep(d)
	}
}

// idle measures the server's memory per open stream.
func (r *runner) idle() error {
	base, haveServer := r.sample()
	cpu0 := selfCPU()
	ms0 := r.serverMemStats()
	endBox := r.boxWindow()
	ramp := r.ramp()
	sleepPhase("settle", r.cfg.settle)
	endBox()
	after, _ := r.sample()
	ms1 := r.serverMemStats()
	cpu1 := selfCPU()
	if haveServer {
		s := r.serverSummary(base, base, after, time.Since(r.began).Seconds(), 0)
		s.CPUCores = 0
		if ramp.Connected > 0 {
			s.RSSPerConnKiB = round3(float64(after.rssKiB-base.rssKiB) / float64(ramp.Connected))
		}
		if ms0 != nil && ms1 != nil && ramp.Connected > 0 {
			ms1.PerConnStack = round3(float64(ms1.StackInuse-ms0.StackInuse) / float64(ramp.Connected))
			ms1.PerConnHeap = round3(float64(ms1.HeapInuse-ms0.HeapInuse) / float64(ramp.Connected))
		}
		s.MemStats = ms1
		r.res.Server = s
	}
	r.res.Client = r.clientSummary(cpu0, cpu1, time.Since(r.began).Seconds(), 0)
	if r.cfg.serverHeapProfile != "" {
		// gc=1: the live heap, after a collection (the RSS above was read
		// before it, as the server left it)
		setPhase("heap profile")
		if err := r.adminToFile("/debug/pprof/heap?gc=1", r.cfg.serverHeapProfile, 30*time.Second); err != nil {
			r.note("heap profile: " + err.Error())
		}
		if ms := r.serverMemStats(); ms != nil && r.res.Server != nil && ramp.Connected > 0 {
			r.note(fmt.Sprintf("after a forced GC: heap alloc %d KiB, heap inuse %d KiB = %.2f KiB/conn over the %d KiB before connecting",
				ms.HeapAlloc, ms.HeapInuse, float64(ms.HeapInuse-ms0.HeapInuse)/float64(ramp.Connected), ms0.HeapInuse))
		}
	}
	sleepPhase("idle-hold", r.cfg.idleHold)
	if ramp.Connected < int64(r.cfg.conns) {
		return fmt.Errorf("only %d of %d streams opened", ramp.Connected, r.cfg.conns)
	}
	return nil
}

// liveClients returns the clients that have connected.
func (r *runner) liveClients() []*client {
	var out []*client
	for _, c := range r.clients {
		if c.everConnected.Load() {
			out = append(out, c)
		}
	}
	return out
}

func (r *runner) newPublisher() publisher {
	if r.redisOpts != nil {
		p := newRedisPublisher(r.redisOpts, r.cfg.redisPrefix, r.cfg.redisHistory, r.cfg.publishers+2, r.cfg.publishTimeout)
		p.note = r.note
		return p
	}
	return newHTTPPublisher(r.pubTarget, r.cfg.secret, r.cfg.publishers+2, r.cfg.publishTimeout)
}

// setupRedisPublish resolves -publish-redis (after the spawn: "spawned" is
// the spawned Redis) and checks that Redis answers. It has its own time
// limit: the spawn before it may have taken up to -spawn-wait, longer than
// the rest of the setup's.
func (r *runner) setupRedisPublish() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r.cfg.publishRedis == "spawned" {
		opts, err := parseRedisURL(ctx, r.redisURL)
		if err != nil {
			return err
		}
		r.redisOpts = opts
	}
	p := newRedisPublisher(r.redisOpts, r.cfg.redisPrefix, r.cfg.redisHistory, 1, r.cfg.publishTimeout)
	defer p.close()
	if err := p.ping(ctx); err != nil {
		return fmt.Errorf("-publish-redis: %v", err)
	}
	r.res.PublishTo = "redis://" + r.redisOpts.Addr + " FCALL " + "sse_publish_v1 " + r.cfg.redisPrefix + "{<channel>}"
	return nil
}

// streamSet is where the measured streams are: this process' engine, or
// the subscriber workers of -procs.
type streamSet interface {
	// open opens the streams (the ramp); it fills in r.res.Ramp.
	open() (*rampSummary, error)
	// begin fixes the streams that count: those that connected.
	begin() error
	// received is how many events the streams received so far.
	received() (int64, error)
	// count compares what the streams received with what the server
	// accepted per channel.
	count(acc []chanAccepted) (tally, error)
	// totals are the final figures (latency and the rest).
	totals() (*statsTotals, error)
}

// localStreams are the streams of this process.
type localStreams struct {
	r    *runner
	live []*client
}

func (l *localStreams) open() (*rampSummary, error) { return l.r.ramp(), nil }
func (l *localStreams) begin() error {
	l.live = l.r.liveClients()
	return nil
}
func (l *localStreams) received() (int64, error) { return l.r.eng.core().received(), nil }
func (l *localStreams) count(acc []chanAccepted) (tally, error) {
	return countDelivered(l.live, acc), nil
}
func (l *localStreams) totals() (*statsTotals, error) { return l.r.eng.core().totals(), nil }

// deliver is fanout, spread and scaleout: streams over channels, events
// published at a rate for a duration; latency, throughput, losses, CPU.
func (r *runner) deliver(ss streamSet) error {
	cfg := r.cfg
	base, haveServer := r.sample()
	ramp, err := ss.open()
	if err != nil {
		return err
	}
	if ramp.Connected == 0 {
		return errors.New("no stream opened")
	}
	sleepPhase("settle", cfg.settle)
	if err := ss.begin(); err != nil {
		return err
	}
	pub := r.newPublisher()
	defer pub.close()

	before, _ := r.sample()
	cpu0 := r.clientCPU()
	recv0, err := ss.received()
	if err != nil {
		return err
	}
	endBox := r.boxWindow()
	waitProfile := r.startCPUProfile(cfg.duration)
	setPhase("publish")
	ctx, cancel := context.WithTimeout(context.Background(), cfg.duration+cfg.drain+30*time.Second)
	defer cancel()
	n := len(r.names)
	plan := pubPlan{
		channels: r.names,
		count:    int(math.Round(cfg.rate * cfg.duration.Seconds())),
		rate:     cfg.rate,
		chanOf:   func(i int) int { return i % n },
		workers:  cfg.publishers,
		ordered:  cfg.ordered,
		event:    cfg.eventType,
		pad:      cfg.pad,
	}
	pres := runPublish(ctx, pub, plan)
	recvEnd, err := ss.received()
	if err != nil {
		return err
	}
	recvPub := recvEnd - recv0
	pubSecs := pres.end.Sub(pres.start).Seconds()

	setPhase("drain")
	acc := acceptedPerChannel(pres)
	drainStart := time.Now()
	drained := false
	var t tally
	for {
		if t, err = ss.count(acc); err != nil {
			return err
		}
		if t.lost == 0 {
			drained = true
			break
		}
		if time.Since(drainStart) > cfg.drain {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	drainSecs := time.Since(drainStart).Seconds()
	endBox()
	after, _ := r.sample()
	cpu1 := r.clientCPU()
	recvNow, err := ss.received()
	if err != nil {
		return err
	}
	recvAll := recvNow - recv0
	window := pubSecs + drainSecs
	waitProfile()

	tot, err := ss.totals()
	if err != nil {
		return err
	}
	d := &deliverySummary{
		Clients: t.clients, Expected: t.expected, Unique: t.unique, Received: recvAll,
		Lost: t.lost, Dupes: tot.dupes, Reordered: tot.reordered, Extra: t.extra, Foreign: tot.foreign,
		Truncated: tot.truncatedEvents, Closing: tot.closing,
		DrainSeconds: round3(drainSecs), Drained: drained,
	}
	if pubSecs > 0 {
		d.PerS = math.Round(float64(recvPub) / pubSecs)
	}
	if window > 0 {
		d.OverallPerS = math.Round(float64(recvAll) / window)
	}
	r.res.Delivery = d
	r.res.Latency = tot.lat.Summary()
	r.res.Publish = pres.summary()
	if haveServer {
		r.res.Server = r.serverSummary(base, before, after, window, recvAll)
	}
	r.res.Client = r.clientSummary(cpu0, cpu1, window, recvAll)
	var problems []string
	if ramp.Connected < int64(cfg.conns) {
		problems = append(problems, fmt.Sprintf("only %d of %d streams opened", ramp.Connected, cfg.conns))
	}
	if !drained {
		problems = append(problems, fmt.Sprintf("%d of %d deliveries missing after the %s drain limit", t.lost, t.expected, cfg.drain))
	}
	if pres.failed.Load() > 0 {
		problems = append(problems, fmt.Sprintf("%d publishes failed", pres.failed.Load()))
	}
	problems = append(problems, deliveryFaults(d, cfg.ordered)...)
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// deliveryFaults are what a correct server never does, whatever the load:
// deliver an event twice, to a stream of another channel, or (with ordered
// publishers) out of order. A run that saw any fails, as one that lost
// events does.
func deliveryFaults(d *deliverySummary, ordered bool) []string {
	var faults []string
	if d.Dupes > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries duplicated", d.Dupes))
	}
	if ordered && d.Reordered > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries out of order", d.Reordered))
	}
	if d.Foreign > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries to a stream of another channel", d.Foreign))
	}
	return faults
}

// reconnectStorm: open streams, give each a Last-Event-ID, reload the
// server, publish events meanwhile, and time until every client has
// reconnected and has every event.
func (r *runner) reconnectStorm() error {
	cfg := r.cfg
	ramp := r.ramp()
	if ramp.Connected == 0 {
		return errors.New("no stream opened")
	}
	sleepPhase("settle", cfg.settle)
	live := r.liveClients()
	pub := r.newPublisher()
	defer pub.close()
	ctx, cancel := context.WithTimeout(context.Background(), cfg.waitTimeout+cfg.reloadTimeout+30*time.Second)
	defer cancel()

	// one event per channel, so that every client has a Last-Event-ID
	setPhase("warm-up")
	n := len(r.names)
	warm := runPublish(ctx, pub, pubPlan{
		channels: r.names, count: n, chanOf: func(i int) int { return i }, workers: cfg.publishers, ordered: true,
		event: cfg.eventType, idem: true, retries: 10,
	})
	if f := warm.failed.Load(); f > 0 {
		// the clients of those channels would have no Last-Event-ID
		r.res.Publish = warm.summary()
		return fmt.Errorf("warm-up: %d of %d publishes failed", f, warm.attempted.Load())
	}
	accWarm := acceptedPerChannel(warm)
	waitEnd := time.Now().Add(cfg.waitTimeout)
	for countDelivered(live, accWarm).lost > 0 {
		if time.Now().After(waitEnd) {
			return fmt.Errorf("warm-up: %d clients did not get their first event", len(live)-countDelivered(live, accWarm).complete)
		}
		time.Sleep(10 * time.Millisecond)
	}
	baseConnects := make([]int32, len(live))
	for i, c := range live {
		baseConnects[i] = c.connects.Load()
	}
	tot0 := r.eng.core().totals()
	before, haveServer := r.sample()
	cpu0 := selfCPU()
	endBox := r.boxWindow()

	setPhase("reload")
	t0 := time.Now()
	reloadDone := make(chan string, 1)
	go func() {
		began := time.Now()
		err := r.reload(ctx)
		status := "ok"
		if err != nil {
			status = err.Error()
		}
		reloadDone <- fmt.Sprintf("%s in %.3fs", status, time.Since(began).Seconds())
	}()
	pubDone := make(chan *pubResult, 1)
	go func() {
		pubDone <- runPublish(ctx, pub, pubPlan{
			channels: r.names, count: cfg.events, rate: cfg.rate, chanOf: func(i int) int { return i % n },
			workers: cfg.publishers, ordered: cfg.ordered, event: cfg.eventType, pad: cfg.pad, idem: true, retries: 20,
			seqBase: warm.seqs,
		})
	}()
	var (
		pres                      *pubResult
		acc                       []chanAccepted
		reloadStatus              string
		allReconnected, allEvents time.Duration
		t                         tally
		reconnected               int
	)
	setPhase("storm")
	deadline := t0.Add(cfg.waitTimeout)
	for {
		select {
		case pres = <-pubDone:
		case reloadStatus = <-reloadDone:
		default:
		}
		reconnected = 0
		for i, c := range live {
			if c.connects.Load() > baseConnects[i] {
				reconnected++
			}
		}
		if reconnected == len(live) && allReconnected == 0 {
			allReconnected = time.Since(t0)
		}
		if pres != nil {
			if acc == nil {
				acc = acceptedPerChannel(warm, pres)
			}
			t = countDelivered(live, acc)
			if t.lost == 0 && allEvents == 0 {
				allEvents = time.Since(t0)
			}
		}
		if allReconnected > 0 && allEvents > 0 {
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	done := max(allReconnected, allEvents)
	if pres == nil {
		pres = <-pubDone // bounded by ctx
	}
	if reloadStatus == "" {
		select {
		case reloadStatus = <-reloadDone:
		case <-time.After(cfg.reloadTimeout):
			reloadStatus = "still running"
		}
	}
	t = countDelivered(live, acceptedPerChannel(warm, pres))
	tot := r.eng.core().totals()
	endBox()
	after, _ := r.sample()
	stormSecs := time.Since(t0).Seconds()
	received := tot.received - tot0.received // in the storm, as fanout's in its window
	if haveServer {
		r.res.Server = r.serverSummary(before, before, after, stormSecs, received)
	}
	r.res.Client = r.clientSummary(cpu0, selfCPU(), stormSecs, received)
	budget := cfg.closeJitter + 5*time.Second
	rs := &reconnectSummary{
		Reload: reloadStatus, AllReconnectedS: round3(allReconnected.Seconds()), AllEventsS: round3(allEvents.Seconds()),
		BudgetS: budget.Seconds(), Clients: len(live), Reconnected: reconnected, Complete: t.complete,
		ServerClosing: tot.closing - tot0.closing, TruncatedReplays: tot.truncatedEvents - tot0.truncatedEvents,
	}
	if allReconnected > 0 && allEvents > 0 {
		rs.DoneS = round3(done.Seconds())
		rs.WithinBudget = done <= budget
	}
	r.res.Reconnect = rs
	d := &deliverySummary{
		Clients: len(live), Expected: t.expected, Unique: t.unique, Received: received,
		Lost: t.lost, Dupes: tot.dupes, Reordered: tot.reordered, Extra: t.extra, Foreign: tot.foreign,
		Truncated: tot.truncatedEvents, Closing: tot.closing, Drained: t.lost == 0,
	}
	if stormSecs > 0 {
		// the publishing overlaps the whole storm: one window for both
		d.PerS = math.Round(float64(received) / stormSecs)
		d.OverallPerS = d.PerS
	}
	r.res.Delivery = d
	r.res.Latency = tot.lat.Summary()
	r.res.Publish = pres.summary()
	var problems []string
	if rs.DoneS == 0 {
		problems = append(problems, fmt.Sprintf("not done within %s: %d of %d clients reconnected, %d complete", cfg.waitTimeout, reconnected, len(live), t.complete))
	}
	if t.lost > 0 || tot.dupes > 0 {
		problems = append(problems, fmt.Sprintf("%d events lost, %d duplicated", t.lost, tot.dupes))
	}
	if f := pres.failed.Load(); f > 0 {
		// their events need not arrive: the loss count cannot vouch for them
		problems = append(problems, fmt.Sprintf("%d publishes failed", f))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// reload triggers a config reload: POST the config to the admin /load
// (forced with Cache-Control: must-revalidate, as `caddy reload --force`),
// or run -reload-cmd.
func (r *runner) reload(ctx context.Context) error {
	cfg := r.cfg
	ctx, cancel := context.WithTimeout(ctx, cfg.reloadTimeout)
	defer cancel()
	if cfg.reloadCmd != "" {
		args := strings.Fields(cfg.reloadCmd)
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", cfg.reloadCmd, err, bytes.TrimSpace(out))
		}
		return nil
	}
	body, err := os.ReadFile(cfg.configPath)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+cfg.admin+"/load", bytes.NewReader(body))
	if err != nil {
		return err
	}
	ct := "text/caddyfile"
	if strings.HasSuffix(cfg.configPath, ".json") {
		ct = "application/json"
	}
	req.Header.Set("Content-Type", ct)
	req.Header.Set("Cache-Control", "must-revalidate")
	hc, err := adminClient(ctx, cfg.admin)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: %d %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}

// startCPUProfile fetches the server's CPU profile over the next d into
// -server-cpuprofile, if set; wait blocks until it is written.
func (r *runner) startCPUProfile(d time.Duration) (wait func()) {
	if r.cfg.serverCPUProfile == "" {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		secs := int(math.Max(1, math.Round(d.Seconds())))
		err := r.adminToFile(fmt.Sprintf("/debug/pprof/profile?seconds=%d", secs), r.cfg.serverCPUProfile, d+60*time.Second)
		if err != nil {
			r.note("cpu profile: " + err.Error())
		}
	}()
	return func() { <-done }
}

// adminToFile GETs path from the admin endpoint into file.
func (r *runner) adminToFile(path, file string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+r.cfg.admin+path, nil)
	if err != nil {
		return err
	}
	hc, err := adminClient(ctx, r.cfg.admin)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: status %d", path, resp.StatusCode)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// serverGoroutines reads the goroutine count from the admin's pprof index,
// summed over every -admin (0 without -admin).
func (r *runner) serverGoroutines() int {
	n := 0
	for _, a := range r.cfg.admins {
		n += adminGoroutines(a)
	}
	return n
}

func adminGoroutines(admin string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	hc, err := adminClient(ctx, admin)
	if err != nil {
		return 0
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/pprof/goroutine?debug=1", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	// goroutine profile: total 20012
	_, n, ok := strings.Cut(strings.TrimSpace(line), "total ")
	if !ok {
		return 0
	}
	v, _ := strconv.Atoi(n)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<20))
	return v
}

// churn opens connections at a rate, each held for a while then closed by
// the client, and measures the connection rate achieved and its errors.
func (r *runner) churn() error {
	cfg := r.cfg
	k := r.eng.core()
	base, haveServer := r.sample()
	cpu0 := selfCPU()
	var lim syscall.Rlimit
	fdLimit := int64(1 << 30)
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil {
		fdLimit = int64(lim.Cur) - 200
	}
	setPhase("churn")
	endBox := r.boxWindow()
	waitProfile := r.startCPUProfile(cfg.duration)
	defer waitProfile()
	start := time.Now()
	var scheduled, skipped, peak int64
	id := 0
	for {
		elapsed := time.Since(start)
		if elapsed >= cfg.duration {
			break
		}
		due := int64(elapsed.Seconds() * cfg.connRate)
		for scheduled < due {
			scheduled++
			open := k.cnt.attempts.Load() - k.cnt.connected.Load() - k.cnt.failed.Load() + k.cnt.live.Load()
			if open >= fdLimit {
				skipped++
				continue
			}
			r.eng.start(r.newClient(id, false, cfg.hold))
			id++
		}
		peak = max(peak, k.cnt.live.Load())
		time.Sleep(time.Millisecond)
	}
	secs := time.Since(start).Seconds()
	endBox()
	connectedAtEnd := k.cnt.connected.Load()
	setPhase("churn-drain")
	end := time.Now().Add(cfg.hold + cfg.headTimeout + 2*time.Second)
	for time.Now().Before(end) {
		if k.cnt.live.Load() == 0 && k.cnt.attempts.Load() == k.cnt.connected.Load()+k.cnt.failed.Load() {
			break
		}
		peak = max(peak, k.cnt.live.Load())
		time.Sleep(5 * time.Millisecond)
	}
	after, _ := r.sample()
	cpu1 := selfCPU()
	tot := k.totals()
	cs := &churnSummary{
		Scheduled: scheduled, Attempted: k.cnt.attempts.Load(), Connected: k.cnt.connected.Load(), Failed: k.cnt.failed.Load(),
		SkippedFDLimit: skipped, Seconds: round3(secs), PeakLive: peak, ConnectLatency: tot.connLat.Summary(),
	}
	if secs > 0 {
		cs.ConnsPerS = math.Round(float64(connectedAtEnd) / secs)
	}
	if cs.Connected > 0 && haveServer {
		cs.ServerCPUPerCon = round3((after.cpuSec - base.cpuSec) / float64(cs.Connected) * 1e6)
	}
	r.res.Churn = cs
	r.res.Conns = int(scheduled)
	wall := time.Since(start).Seconds()
	if haveServer {
		r.res.Server = r.serverSummary(base, base, after, wall, 0)
	}
	r.res.Client = r.clientSummary(cpu0, cpu1, wall, 0)
	if cs.Failed > 0 || skipped > 0 {
		return fmt.Errorf("%d connection attempts failed, %d skipped at the fd limit", cs.Failed, skipped)
	}
	return nil
}

// printSummary writes the human summary on stderr.
func (r *runner) printSummary() {
	res := r.res
	w := r.stderr
	fmt.Fprintf(w, "\n== ssebench %s (%s engine, %s) conns=%d channels=%d", res.Scenario, res.Engine, res.Proto, res.Conns, res.Channels)
	if res.Rate > 0 && res.Scenario != "churn" {
		fmt.Fprintf(w, " rate=%g/s", res.Rate)
	}
	fmt.Fprintf(w, "  load %s → %s\n", res.LoadStart, res.LoadEnd)
	if s := res.Ramp; s != nil {
		fmt.Fprintf(w, "ramp:      %d/%d open in %.2fs = %.0f conns/s (connect p50 %.2f ms p99 %.2f ms), %d failed attempts%s; cpu server %.2fs (%.0f µs/conn) client %.2fs\n",
			s.Connected, s.Conns, s.Seconds, s.ConnsPerS, s.ConnectLatency.P50ms, s.ConnectLatency.P99ms, s.Failed, map[bool]string{true: " TIMED OUT"}[s.TimedOut],
			s.ServerCPUs, s.ServerCPUPerUs, s.ClientCPUs)
	}
	if s := res.Server; s != nil {
		fmt.Fprintf(w, "server:    pid %d rss %d KiB (base %d, peak %d)", s.PID, s.RSSKiB, s.RSSBaseKiB, s.HWMKiB)
		if s.RSSPerConnKiB != 0 {
			fmt.Fprintf(w, " = %.2f KiB/conn", s.RSSPerConnKiB)
		}
		fmt.Fprintf(w, "; cpu %.2fs (%.2f cores)", s.CPUSeconds, s.CPUCores)
		if s.CPUPerDeliveryUs > 0 {
			fmt.Fprintf(w, " = %.2f µs/delivery", s.CPUPerDeliveryUs)
		}
		fmt.Fprintf(w, "; %d threads, %d fds (%d before)", s.Threads, s.FDs, s.FDsBase)
		if s.Goroutines > 0 {
			fmt.Fprintf(w, ", %d goroutines", s.Goroutines)
		}
		fmt.Fprintln(w)
		for i, p := range s.Processes {
			fmt.Fprintf(w, "server %d:  pid %d rss %d KiB (base %d, peak %d); cpu %.2fs (%.2f cores); %d fds\n",
				i, p.PID, p.RSSKiB, p.RSSBaseKiB, p.HWMKiB, p.CPUSeconds, p.CPUCores, p.FDs)
		}
		if m := s.MemStats; m != nil {
			fmt.Fprintf(w, "memstats:  heap inuse %d KiB (%.2f KiB/conn), stacks %d KiB (%.2f KiB/conn), idle unreleased heap %d KiB, sys %d KiB, %d GCs\n",
				m.HeapInuse, m.PerConnHeap, m.StackInuse, m.PerConnStack, m.HeapIdle, m.Sys, m.NumGC)
		}
	}
	if s := res.Redis; s != nil {
		fmt.Fprintf(w, "redis:     pid %d %s rss %d KiB (base %d, peak %d); cpu %.2fs (%.2f cores)\n",
			s.PID, s.URL, s.RSSKiB, s.RSSBaseKiB, s.HWMKiB, s.CPUSeconds, s.CPUCores)
	}
	if s := res.Client; s != nil {
		fmt.Fprintf(w, "client:    cpu %.2fs (%.2f cores)", s.CPUSeconds, s.CPUCores)
		if s.CPUPerDeliveryUs > 0 {
			fmt.Fprintf(w, " = %.2f µs/delivery", s.CPUPerDeliveryUs)
		}
		fmt.Fprintf(w, "; rss %d KiB", s.RSSKiB)
		if len(s.Procs) > 0 {
			fmt.Fprintf(w, " (this process and %d subscriber processes:", len(s.Procs))
			for _, p := range s.Procs {
				fmt.Fprintf(w, " pid %d %d streams %.2fs cpu %d KiB;", p.PID, p.Conns, p.CPUSeconds, p.RSSKiB)
			}
			fmt.Fprint(w, ")")
		}
		fmt.Fprintln(w)
	}
	if s := res.Publish; s != nil {
		fmt.Fprintf(w, "publish:   %d/%d ok%s in %.2fs (%.1f/s, ordered=%v), rtt p50 %.2f ms p99 %.2f ms, behind schedule p50 %.2f ms max %.2f ms\n",
			s.OK, s.Attempted, failedNote(s.Failed), s.Seconds, s.PerS, s.Ordered, s.RTT.P50ms, s.RTT.P99ms, s.Lag.P50ms, s.Lag.MaxMs)
	}
	if s := res.Delivery; s != nil {
		fmt.Fprintf(w, "delivery:  %d/%d unique to %d clients, lost %d, dupes %d, reordered %d, %.0f/s while publishing (%.0f/s overall), drain %.2fs\n",
			s.Unique, s.Expected, s.Clients, s.Lost, s.Dupes, s.Reordered, s.PerS, s.OverallPerS, s.DrainSeconds)
	}
	if s := res.Latency; s != nil && s.N > 0 {
		fmt.Fprintf(w, "latency:   p50 %.2f ms  p90 %.2f ms  p99 %.2f ms  p99.9 %.2f ms  max %.2f ms (n=%d)\n", s.P50ms, s.P90ms, s.P99ms, s.P999ms, s.MaxMs, s.N)
	}
	if s := res.Reconnect; s != nil {
		fmt.Fprintf(w, "reconnect: reload %s; all reconnected %.2fs, all events %.2fs → done %.2fs (budget %.0fs: %v); %d/%d complete, %d truncated\n",
			s.Reload, s.AllReconnectedS, s.AllEventsS, s.DoneS, s.BudgetS, s.WithinBudget, s.Complete, s.Clients, s.TruncatedReplays)
	}
	if s := res.Churn; s != nil {
		fmt.Fprintf(w, "churn:     %d connected / %d attempted in %.2fs = %.0f conns/s, %d failed, peak %d live, connect p50 %.2f ms p99 %.2f ms, server %.1f µs cpu/conn\n",
			s.Connected, s.Attempted, s.Seconds, s.ConnsPerS, s.Failed, s.PeakLive, s.ConnectLatency.P50ms, s.ConnectLatency.P99ms, s.ServerCPUPerCon)
	}
	if c := res.Conn; c != nil {
		fmt.Fprintf(w, "streams:   %d attempts, %d connected, %d failed, %d ended by server, %d reconnects", c.Attempts, c.Connected, c.Failed, c.Ended, c.Reconnects)
		if c.Dials > 0 {
			fmt.Fprintf(w, ", %d TCP dials", c.Dials)
		}
		if c.EpollWaits > 0 {
			fmt.Fprintf(w, "; %d reads, %.1f ready per epoll_wait", c.Reads, float64(c.ReadyEvents)/float64(c.EpollWaits))
		}
		fmt.Fprintln(w)
	}
	if b := res.Box; b != nil {
		fmt.Fprintf(w, "box:       %.2f of %d cores busy over %.1fs: server %.2f, ", b.BusyCores, b.Cores, b.Seconds, b.ServerCores)
		if b.RedisCores > 0 {
			fmt.Fprintf(w, "redis %.2f, ", b.RedisCores)
		}
		fmt.Fprintf(w, "ssebench %.2f, ksoftirqd %.2f, others %.2f\n", b.ClientCores, b.SoftirqCores, b.OtherCores)
	}
	for _, e := range sortedErrs(res.Errors) {
		fmt.Fprintf(w, "error:     %s ×%d\n", e, res.Errors[e])
	}
	for _, n := range res.Notes {
		fmt.Fprintf(w, "note:      %s\n", n)
	}
	if res.Error != "" {
		fmt.Fprintf(w, "FAILED:    %s\n", res.Error)
	}
	if len(r.serverLogPaths) > 0 {
		fmt.Fprintf(w, "server log: %s\n", strings.Join(r.serverLogPaths, ", "))
	}
	if r.redisLogPath != "" {
		fmt.Fprintf(w, "redis log: %s\n", r.redisLogPath)
	}
}
