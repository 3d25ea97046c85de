package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// boxWindow starts measuring the machine's CPU; end records the window.
func (r *runner) boxWindow() (end func()) {
	cpu0, ok := machineCPU()
	srv0, _ := r.sample()
	self0 := r.clientCPU()
	soft0 := softirqCPU()
	t0 := time.Now()
	return func() {
		cpu1, ok1 := machineCPU()
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
			BusyCores:   round3((cpu1.busy - cpu0.busy) / secs),
			StealCores:  round3((cpu1.steal - cpu0.steal) / secs),
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
		if b.StealCores > r.cfg.quietCores {
			r.note(fmt.Sprintf("slowed host: the hypervisor took %.2f cores from this machine (steal) during the measurement", b.StealCores))
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
		cpu0, ok := machineCPU()
		srv0, _ := r.sample()
		self0 := r.clientCPU()
		time.Sleep(2 * time.Second)
		cpu1, ok1 := machineCPU()
		srv1, _ := r.sample()
		if !ok || !ok1 {
			return
		}
		others := (cpu1.busy - cpu0.busy - (srv1.cpuSec - srv0.cpuSec) - (srv1.redisCPU() - srv0.redisCPU()) - (r.clientCPU() - self0)) / 2
		steal := (cpu1.steal - cpu0.steal) / 2
		if others+steal < r.cfg.quietCores {
			return
		}
		if time.Now().After(deadline) {
			r.note(fmt.Sprintf("the machine was still busy (%.2f cores used by others, %.2f taken by the hypervisor) after -quiet-wait %s", others, steal, r.cfg.quietWait))
			return
		}
		if !r.cfg.quiet {
			fmt.Fprintf(r.stderr, "ssebench: waiting for a quiet machine (others use %.2f cores, the hypervisor takes %.2f)\n", others, steal)
		}
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
	redisCmd  []string // the spawned Redis' command line, to start it again (-chaos kill-redis)
	// redisKilled: -chaos killed the spawned Redis; its figures span two processes
	redisKilled bool
	// serverKilled: -chaos killed a spawned server; the servers' figures
	// would mix processes
	serverKilled bool
	redisOpts    *redis.Options // -publish-redis

	serverLogPaths []string
	redisLogPath   string

	notesMu sync.Mutex // the progress goroutine notes too (a failed /proc read)

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

// note adds a line to the result's notes, once: the progress goroutine
// notes a failed /proc read at every sample.
func (r *runner) note(s string) {
	r.notesMu.Lock()
	defer r.notesMu.Unlock()
	if !slices.Contains(r.res.Notes, s) {
		r.res.Notes = append(r.res.Notes, s)
	}
}

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
	if cfg.publishAs != "caddy-sse" {
		r.res.PublishTo = cfg.publishAs + " " + pubRaw
	}
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
		// every server the run loads, as with several -spawn: the
		// figures are divided by the deliveries of every stream
		pids, err := listenerPIDs(append(slices.Clone(r.targets), r.pubTarget))
		if err != nil {
			r.note("server metrics unavailable: " + err.Error())
			break
		}
		r.pid = pids[0]
		if len(pids) > 1 {
			r.pids = pids
		}
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
	var sum procSample
	r.mu.Lock()
	pids := slices.Clone(r.pids) // -chaos kill-server replaces one
	rds := r.redis
	r.mu.Unlock()
	if len(pids) == 0 && r.pid != 0 {
		pids = []int{r.pid}
	}
	if rds != nil {
		if s, err := readProc(rds.pid()); err == nil {
			sum.redis = &s
		}
	}
	if len(pids) == 0 {
		return sum, false
	}
	for _, pid := range pids {
		if pid == 0 {
			return sum, false // killed by -chaos, not started again yet
		}
		s, err := readProcTree(pid)
		if err != nil {
			r.note(fmt.Sprintf("reading /proc/%d: %v", pid, err))
			return sum, false
		}
		sum.rssKiB += s.rssKiB
		sum.hwmKiB += s.hwmKiB
		sum.cpuSec += s.cpuSec
		sum.userSec += s.userSec
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
		s.UserPerDeliveryUs = round3((after.userSec - before.userSec) / float64(deliveries) * 1e6)
	}
	s.Goroutines = r.serverGoroutines()
	if len(after.per) > 1 && len(after.per) == len(before.per) && len(after.per) == len(base.per) {
		s.PIDs = r.pids
		for i, a := range after.per {
			s.Processes = append(s.Processes, procDelta(r.pids[i], base.per[i], before.per[i], a, secs))
		}
	}
	if r.redisKilled {
		r.note("no Redis figures: -chaos killed and restarted it (two processes)")
	} else if after.redis != nil && before.redis != nil && base.redis != nil {
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
	// the streams the server holds now: one that ended since the ramp
	// (and is not open again) no longer costs it memory
	open := r.eng.core().cnt.live.Load()
	ms1 := r.serverMemStats()
	cpu1 := selfCPU()
	if haveServer {
		s := r.serverSummary(base, base, after, time.Since(r.began).Seconds(), 0)
		s.CPUCores = 0
		if open > 0 {
			s.RSSPerConnKiB = round3(float64(after.rssKiB-base.rssKiB) / float64(open))
		}
		if ms0 != nil && ms1 != nil && open > 0 {
			ms1.PerConnStack = round3(float64(ms1.StackInuse-ms0.StackInuse) / float64(open))
			ms1.PerConnHeap = round3(float64(ms1.HeapInuse-ms0.HeapInuse) / float64(open))
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
		if ms := r.serverMemStats(); ms != nil && r.res.Server != nil && open > 0 {
			r.note(fmt.Sprintf("after a forced GC: heap alloc %d KiB, heap inuse %d KiB = %.2f KiB/conn over the %d KiB before connecting",
				ms.HeapAlloc, ms.HeapInuse, float64(ms.HeapInuse-ms0.HeapInuse)/float64(open), ms0.HeapInuse))
		}
	}
	sleepPhase("idle-hold", r.cfg.idleHold)
	if ramp.Connected < int64(r.cfg.conns) {
		return fmt.Errorf("only %d of %d streams opened", ramp.Connected, r.cfg.conns)
	}
	if open < ramp.Connected {
		return fmt.Errorf("only %d of the %d streams opened were open when the memory was read", open, ramp.Connected)
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
	if r.cfg.publishAs != "caddy-sse" {
		return newRivalPublisher(r.cfg.publishAs, r.pubTarget, r.cfg.secret, r.cfg.publishers+2, r.cfg.publishTimeout)
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
