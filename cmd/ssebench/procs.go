package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// -procs: the streams are opened by child processes of this tool (one
// process may hold at most RLIMIT_NOFILE sockets), each a hidden
// `ssebench subscribe-worker` with its share of the clients; the parent
// publishes, asks the workers for their tallies over a line protocol
// (commands on the worker's stdin, one JSON message per line on its
// stdout) and merges them. Latency is measured by each worker against the
// time in the event's data, set by the parent: CLOCK_MONOTONIC (monoNow),
// which the processes of a box share, so comparable across processes.
//
// Commands: "begin" (freeze the set of connected streams that the tallies
// cover), "tally" (optionally followed by a space and the JSON of what the
// server accepted per channel, []chanAccepted, to count against), "report",
// "exit" (or EOF: close the streams and exit).
// Messages: ready (after the ramp), progress (every second), begun,
// tally, report, error.

const workerCommand = "subscribe-worker"

// workerMsg is one line of a worker's stdout.
type workerMsg struct {
	Type     string          `json:"type"`
	Error    string          `json:"error,omitempty"`
	Ramp     *rampSummary    `json:"ramp,omitempty"`
	ConnLat  *histogram      `json:"conn_lat,omitempty"` // ready: connect latency of the ramp
	Progress *workerProgress `json:"progress,omitempty"`
	Tally    *workerTally    `json:"tally,omitempty"`
	Report   *workerReport   `json:"report,omitempty"`
}

type workerProgress struct {
	Live      int64 `json:"live"`
	Connected int64 `json:"connected"`
	Failed    int64 `json:"failed"`
	Received  int64 `json:"received"`
}

// workerTally is what a worker's streams received: per channel, how many
// streams have how many of its accepted events (the parent sends what the
// server accepted with the tally command, and computes the lost deliveries
// from those counts), the distinct events received that the server had not
// accepted (extra), and the totals.
type workerTally struct {
	Clients   int               `json:"clients"`
	Received  int64             `json:"received"`
	Dupes     int64             `json:"dupes"`
	Reordered int64             `json:"reordered"`
	Extra     int64             `json:"extra"`
	Chans     []map[int64]int64 `json:"chans"`
}

// workerReport is a worker's final figures.
type workerReport struct {
	Lat        *histogram       `json:"lat"`
	ConnLat    *histogram       `json:"conn_lat"`
	Foreign    int64            `json:"foreign"`
	Unparsed   int64            `json:"unparsed"`
	Closing    int64            `json:"closing"`
	Truncated  int64            `json:"truncated"`
	Conn       *connSummary     `json:"conn"`
	Errors     map[string]int64 `json:"errors,omitempty"`
	CPUSeconds float64          `json:"cpu_s"`
	RSSKiB     int64            `json:"rss_kib"`
}

// runWorker is `ssebench subscribe-worker`: open the streams, report
// ready, then answer the parent's commands until "exit" or EOF.
func runWorker(args []string) int {
	c := &config{scenario: workerCommand}
	fs := flag.NewFlagSet(workerCommand, flag.ContinueOnError)
	c.flags(fs)
	fs.IntVar(&c.idBase, "id-base", 0, "the first client id")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	c.splitLists()
	var outMu sync.Mutex
	enc := json.NewEncoder(os.Stdout)
	emit := func(m workerMsg) {
		outMu.Lock()
		defer outMu.Unlock()
		_ = enc.Encode(m)
	}
	fail := func(err error) int {
		emit(workerMsg{Type: "error", Error: err.Error()})
		return 1
	}
	if len(c.urls) != 1 || c.conns < 1 || c.channels < 1 || c.perConn < 1 || c.perConn > c.channels {
		return fail(errors.New("subscribe-worker: want one -url, -conns ≥ 1, 1 ≤ -per-conn ≤ -channels"))
	}
	// bounded like every run: the parent's limit, and the parent's death
	// (PDEATHSIG; EOF on stdin otherwise)
	watchdog := time.AfterFunc(c.totalTimeout, func() {
		emit(workerMsg{Type: "error", Error: fmt.Sprintf("worker exceeded -timeout %s", c.totalTimeout)})
		os.Exit(3)
	})
	defer watchdog.Stop()
	r := newRunner(c, io.Discard, os.Stderr)
	if err := r.setup(); err != nil {
		return fail(err)
	}
	defer func() { _ = r.eng.closeAll(15 * time.Second) }()
	k := r.eng.core()
	ramp := r.ramp()
	tot := k.totals()
	emit(workerMsg{Type: "ready", Ramp: ramp, ConnLat: &tot.connLat})

	progress := func() {
		emit(workerMsg{Type: "progress", Progress: &workerProgress{
			Live: k.cnt.live.Load(), Connected: k.cnt.connected.Load(), Failed: k.cnt.failed.Load(), Received: k.received(),
		}})
	}
	progress()
	stopProgress := make(chan struct{})
	defer close(stopProgress)
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-stopProgress:
				return
			case <-t.C:
			}
			progress()
		}
	}()

	live := r.liveClients()
	cpu0 := selfCPU()
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 64<<10), 256<<20) // a tally's accepted sets
	for sc.Scan() {
		cmd, arg, _ := strings.Cut(sc.Text(), " ")
		switch cmd {
		case "begin":
			live = r.liveClients()
			emit(workerMsg{Type: "begun"})
		case "tally":
			var acc []chanAccepted
			if arg != "" {
				if err := json.Unmarshal([]byte(arg), &acc); err != nil {
					return fail(fmt.Errorf("tally: %v", err))
				}
			}
			emit(workerMsg{Type: "tally", Tally: workerTallyOf(live, c.channels, k, acc)})
		case "report":
			t := k.totals()
			rep := &workerReport{
				Lat: &t.lat, ConnLat: &t.connLat, Foreign: t.foreign, Unparsed: t.unparsed, Closing: t.closing, Truncated: t.truncatedEvents,
				Conn: connSummaryOf(k), CPUSeconds: round3(selfCPU() - cpu0),
			}
			if errs := k.errors(); len(errs) > 0 {
				rep.Errors = errs
			}
			if me, err := readProc(os.Getpid()); err == nil {
				rep.RSSKiB = me.rssKiB
			}
			emit(workerMsg{Type: "report", Report: rep})
		case "exit":
			return 0
		}
	}
	return 0
}

// workerTallyOf tallies the live streams against acc, what the server
// accepted per channel; without acc (a tally for the totals only) every
// distinct event counts.
func workerTallyOf(live []*client, channels int, k *core, acc []chanAccepted) *workerTally {
	t := &workerTally{Clients: len(live), Chans: make([]map[int64]int64, channels), Received: k.received()}
	for _, c := range live {
		for s, ch := range c.chans {
			m := t.Chans[ch]
			if m == nil {
				m = map[int64]int64{}
				t.Chans[ch] = m
			}
			got := c.uniq[s].Load()
			if int(ch) < len(acc) {
				var extra int64
				got, extra = c.acceptedSeen(s, &acc[ch])
				t.Extra += extra
			}
			m[got]++
		}
	}
	tot := k.totals()
	t.Dupes, t.Reordered = tot.dupes, tot.reordered
	return t
}

func connSummaryOf(k *core) *connSummary {
	return &connSummary{
		Attempts: k.cnt.attempts.Load(), Connected: k.cnt.connected.Load(), Failed: k.cnt.failed.Load(),
		GaveUp: k.cnt.gaveUp.Load(), Ended: k.cnt.ended.Load(), ClosedByUs: k.cnt.closedByUs.Load(),
		Reconnects: k.cnt.reconnects.Load(), TruncatedHead: k.cnt.truncatedHead.Load(), Dials: k.cnt.dials.Load(),
		EpollWaits: k.cnt.waits.Load(), ReadyEvents: k.cnt.ready.Load(), Reads: k.cnt.reads.Load(),
	}
}

func (s *connSummary) add(o *connSummary) {
	s.Attempts += o.Attempts
	s.Connected += o.Connected
	s.Failed += o.Failed
	s.GaveUp += o.GaveUp
	s.Ended += o.Ended
	s.ClosedByUs += o.ClosedByUs
	s.Reconnects += o.Reconnects
	s.TruncatedHead += o.TruncatedHead
	s.Dials += o.Dials
	s.EpollWaits += o.EpollWaits
	s.ReadyEvents += o.ReadyEvents
	s.Reads += o.Reads
}

// workerProc is the parent's handle on a worker.
type workerProc struct {
	i     int
	p     *proc
	url   string
	conns int
	stdin *os.File
	msgs  chan workerMsg // every message but progress; closed at EOF

	mu   sync.Mutex
	prog workerProgress
}

func (w *workerProc) read(out *os.File) {
	defer close(w.msgs)
	defer out.Close()
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 256<<20)
	for sc.Scan() {
		var m workerMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			m = workerMsg{Type: "error", Error: fmt.Sprintf("worker %d: bad message: %v", w.i, err)}
		}
		if m.Type == "progress" && m.Progress != nil {
			w.mu.Lock()
			w.prog = *m.Progress
			w.mu.Unlock()
			continue
		}
		select {
		case w.msgs <- m:
		default: // full: the parent is not asking; do not outlive the worker
			select {
			case w.msgs <- m:
			case <-w.p.done:
				return
			}
		}
	}
}

// workerArgs are the flags of worker i.
func (r *runner) workerArgs(url string, conns, idBase int) []string {
	cfg := r.cfg
	d := func(v time.Duration) string { return v.String() }
	return []string{workerCommand,
		"-url", url, "-conns", strconv.Itoa(conns), "-id-base", strconv.Itoa(idBase),
		"-channels", strconv.Itoa(cfg.channels), "-per-conn", strconv.Itoa(cfg.perConn), "-channel-prefix", cfg.channelPrefix,
		"-engine", cfg.engine, "-proto", cfg.proto, "-h2-conns", strconv.Itoa(cfg.h2Conns), "-workers", strconv.Itoa(cfg.workers), "-uring=" + strconv.FormatBool(cfg.uring),
		"-src", cfg.src, "-inflight", strconv.Itoa(cfg.inflight), "-read-buf", strconv.Itoa(cfg.readBuf),
		"-ramp-timeout", d(cfg.rampTimeout), "-head-timeout", d(cfg.headTimeout), "-default-retry", d(cfg.defaultRetry),
		"-reconnect=" + strconv.FormatBool(cfg.reconnect), "-timeout", d(cfg.totalTimeout + cfg.quietWait + time.Minute), "-q",
	}
}

// startWorkers starts cfg.procs workers; worker i opens its share of the
// streams on URL i mod the URL count, with client ids following the
// previous worker's (so channels are assigned as by one process).
func (r *runner) startWorkers() error {
	cfg := r.cfg
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	base := 0
	for i := range cfg.procs {
		share := cfg.conns / cfg.procs
		if i < cfg.conns%cfg.procs {
			share++
		}
		url := cfg.urls[i%len(cfg.urls)]
		inR, inW, err := os.Pipe()
		if err != nil {
			return err
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			inR.Close()
			inW.Close()
			return err
		}
		cmd := exec.Command(exe, r.workerArgs(url, share, base)...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, os.Stderr
		p, err := startProc(fmt.Sprintf("worker %d", i), cmd, "")
		inR.Close()
		outW.Close()
		if err != nil {
			inW.Close()
			outR.Close()
			return fmt.Errorf("-procs: %v", err)
		}
		w := &workerProc{i: i, p: p, url: url, conns: share, stdin: inW, msgs: make(chan workerMsg, 16)}
		go w.read(outR)
		r.mu.Lock()
		r.workers = append(r.workers, w)
		r.mu.Unlock()
		base += share
	}
	return nil
}

func (r *runner) workerList() []*workerProc {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*workerProc(nil), r.workers...)
}

// await waits for a message of type want from every worker (skipping
// stale ones), within timeout.
func await(workers []*workerProc, want string, timeout time.Duration) ([]workerMsg, error) {
	out := make([]workerMsg, len(workers))
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for i, w := range workers {
		for {
			var m workerMsg
			var ok bool
			select {
			case m, ok = <-w.msgs:
			case <-deadline.C:
				return nil, fmt.Errorf("worker %d (pid %d): no %s within %s", w.i, w.p.pid(), want, timeout)
			}
			if !ok {
				return nil, fmt.Errorf("worker %d (pid %d) exited", w.i, w.p.pid())
			}
			if m.Type == "error" {
				return nil, fmt.Errorf("worker %d (pid %d): %s", w.i, w.p.pid(), m.Error)
			}
			if m.Type == want {
				out[i] = m
				break
			}
		}
	}
	return out, nil
}

// ask sends cmd to every worker and waits for their answers.
func (r *runner) ask(cmd, want string, timeout time.Duration) ([]workerMsg, error) {
	workers := r.workerList()
	if len(workers) == 0 {
		return nil, errors.New("no workers")
	}
	for _, w := range workers {
		if _, err := w.stdin.WriteString(cmd + "\n"); err != nil {
			return nil, fmt.Errorf("worker %d (pid %d): %v", w.i, w.p.pid(), err)
		}
	}
	return await(workers, want, timeout)
}

// stopWorkers asks the workers to close their streams and exit, and kills
// (by pid) those that do not within the time limit.
func (r *runner) stopWorkers() {
	r.mu.Lock()
	workers := r.workers
	r.workers = nil
	r.mu.Unlock()
	var ps []*proc
	for _, w := range workers {
		_, _ = w.stdin.WriteString("exit\n")
		w.stdin.Close()
		ps = append(ps, w.p)
	}
	waitExited(ps, 20*time.Second)
	stopProcs(ps, syscall.SIGKILL, 5*time.Second)
}

// workerStreams is the streamSet of -procs.
type workerStreams struct {
	r       *runner
	acc     []byte // the tally command's argument: what count was given, as JSON
	last    []*workerTally
	reports []*workerReport
	connLat histogram
}

const askTimeout = 30 * time.Second

func (s *workerStreams) open() (*rampSummary, error) {
	r := s.r
	cfg := r.cfg
	setPhase("ramp")
	before, haveServer := r.sample()
	cpu0 := r.clientCPU()
	start := time.Now()
	if err := r.startWorkers(); err != nil {
		return nil, err
	}
	msgs, err := await(r.workerList(), "ready", cfg.rampTimeout+cfg.spawnWait)
	if err != nil {
		return nil, err
	}
	secs := time.Since(start).Seconds()
	rs := &rampSummary{Conns: cfg.conns, Seconds: round3(secs)}
	for _, m := range msgs {
		if m.Ramp != nil {
			rs.Connected += m.Ramp.Connected
			rs.Failed += m.Ramp.Failed
			rs.GaveUp += m.Ramp.GaveUp
			rs.TimedOut = rs.TimedOut || m.Ramp.TimedOut
		}
		if m.ConnLat != nil {
			s.connLat.Merge(m.ConnLat)
		}
	}
	rs.ConnectLatency = s.connLat.Summary()
	if secs > 0 {
		rs.ConnsPerS = math.Round(float64(rs.Connected) / secs)
	}
	rs.ClientCPUs = round3(r.clientCPU() - cpu0)
	if after, ok := r.sample(); ok && haveServer {
		rs.ServerCPUs = round3(after.cpuSec - before.cpuSec)
		if rs.Connected > 0 {
			rs.ServerCPUPerUs = round3(rs.ServerCPUs / float64(rs.Connected) * 1e6)
		}
	}
	r.res.Ramp = rs
	return rs, nil
}

func (s *workerStreams) begin() error {
	_, err := s.r.ask("begin", "begun", askTimeout)
	return err
}

func (s *workerStreams) tally() error {
	cmd := "tally"
	if s.acc != nil {
		cmd += " " + string(s.acc)
	}
	msgs, err := s.r.ask(cmd, "tally", askTimeout)
	if err != nil {
		return err
	}
	s.last = s.last[:0]
	for _, m := range msgs {
		if m.Tally == nil {
			return errors.New("a worker's tally is empty")
		}
		s.last = append(s.last, m.Tally)
	}
	return nil
}

func (s *workerStreams) received() (int64, error) {
	if err := s.tally(); err != nil {
		return 0, err
	}
	var n int64
	for _, t := range s.last {
		n += t.Received
	}
	return n, nil
}

func (s *workerStreams) count(acc []chanAccepted) (tally, error) {
	b, err := json.Marshal(acc)
	if err != nil {
		return tally{}, err
	}
	s.acc = b
	if err := s.tally(); err != nil {
		return tally{}, err
	}
	return countWire(s.last, acc), nil
}

// countWire is countDelivered over the workers' tallies (made against acc).
func countWire(ts []*workerTally, acc []chanAccepted) tally {
	var t tally
	for _, wt := range ts {
		t.clients += wt.Clients
		t.extra += wt.Extra
		for ch, m := range wt.Chans {
			var exp int64
			if ch < len(acc) {
				exp = acc[ch].N
			}
			for got, n := range m {
				t.add(exp, got, n)
			}
		}
	}
	return t
}

func (s *workerStreams) totals() (*statsTotals, error) {
	r := s.r
	if err := s.tally(); err != nil {
		return nil, err
	}
	msgs, err := r.ask("report", "report", askTimeout)
	if err != nil {
		return nil, err
	}
	t := &statsTotals{}
	conn := &connSummary{}
	errs := map[string]int64{}
	s.reports = s.reports[:0]
	for i, m := range msgs {
		rep := m.Report
		if rep == nil || rep.Lat == nil || rep.ConnLat == nil || rep.Conn == nil {
			return nil, fmt.Errorf("worker %d: incomplete report", i)
		}
		s.reports = append(s.reports, rep)
		t.lat.Merge(rep.Lat)
		t.connLat.Merge(rep.ConnLat)
		t.foreign += rep.Foreign
		t.unparsed += rep.Unparsed
		t.closing += rep.Closing
		t.truncatedEvents += rep.Truncated
		conn.add(rep.Conn)
		for e, n := range rep.Errors {
			errs[e] += n
		}
	}
	for _, wt := range s.last {
		t.received += wt.Received
		t.dupes += wt.Dupes
		t.reordered += wt.Reordered
	}
	r.res.Conn = conn
	if len(errs) > 0 {
		r.res.Errors = errs
	}
	return t, nil
}

// clientCPU is this process' CPU seconds plus its workers'.
func (r *runner) clientCPU() float64 {
	cpu := selfCPU()
	for _, w := range r.workerList() {
		if s, err := readProc(w.p.pid()); err == nil {
			cpu += s.cpuSec
		}
	}
	return cpu
}

// workerSummaries are the workers' figures for the JSON.
func (r *runner) workerSummaries() []procSummary {
	var out []procSummary
	for _, w := range r.workerList() {
		ps := procSummary{PID: w.p.pid(), Conns: w.conns, URL: w.url}
		if s, err := readProc(w.p.pid()); err == nil {
			ps.RSSKiB, ps.HWMKiB, ps.CPUSeconds, ps.FDs, ps.Threads = s.rssKiB, s.hwmKiB, round3(s.cpuSec), s.fds, s.threads
		}
		out = append(out, ps)
	}
	return out
}

// workerProgressLine sums the workers' last progress messages.
func (r *runner) workerProgressLine() string {
	var p workerProgress
	for _, w := range r.workerList() {
		w.mu.Lock()
		p.Live += w.prog.Live
		p.Connected += w.prog.Connected
		p.Failed += w.prog.Failed
		p.Received += w.prog.Received
		w.mu.Unlock()
	}
	return fmt.Sprintf("live %d connected %d failed %d received %d (%d procs)", p.Live, p.Connected, p.Failed, p.Received, r.cfg.procs)
}
