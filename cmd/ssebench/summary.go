package main

import (
	"fmt"
	"io"
	"strings"
)

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
		printServer(w, s)
	}
	if s := res.Redis; s != nil {
		fmt.Fprintf(w, "redis:     pid %d %s rss %d KiB (base %d, peak %d); cpu %.2fs (%.2f cores)\n",
			s.PID, s.URL, s.RSSKiB, s.RSSBaseKiB, s.HWMKiB, s.CPUSeconds, s.CPUCores)
	}
	if s := res.Client; s != nil {
		printClient(w, s)
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
		printConn(w, c)
	}
	if b := res.Box; b != nil {
		printBox(w, b)
	}
	for _, e := range sortedErrs(res.Errors) {
		fmt.Fprintf(w, "error:     %s ×%d\n", e, res.Errors[e])
	}
	for _, c := range res.Chaos {
		printChaos(w, c)
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

// printServer writes the server's line, its processes' and its memory
// statistics.
func printServer(w io.Writer, s *serverSummary) {
	fmt.Fprintf(w, "server:    pid %d rss %d KiB (base %d, peak %d)", s.PID, s.RSSKiB, s.RSSBaseKiB, s.HWMKiB)
	if s.RSSPerConnKiB != 0 {
		fmt.Fprintf(w, " = %.2f KiB/conn", s.RSSPerConnKiB)
	}
	fmt.Fprintf(w, "; cpu %.2fs (%.2f cores)", s.CPUSeconds, s.CPUCores)
	if s.CPUPerDeliveryUs > 0 {
		fmt.Fprintf(w, " = %.2f µs/delivery (user %.2f)", s.CPUPerDeliveryUs, s.UserPerDeliveryUs)
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

// printClient writes the load tool's own line.
func printClient(w io.Writer, s *clientSummary) {
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

// printConn writes what the streams did.
func printConn(w io.Writer, c *connSummary) {
	fmt.Fprintf(w, "streams:   %d attempts, %d connected, %d failed, %d ended by server, %d reconnects", c.Attempts, c.Connected, c.Failed, c.Ended, c.Reconnects)
	if c.Dials > 0 {
		fmt.Fprintf(w, ", %d TCP dials", c.Dials)
	}
	if c.EpollWaits > 0 {
		fmt.Fprintf(w, "; %d reads, %.1f ready per epoll_wait", c.Reads, float64(c.ReadyEvents)/float64(c.EpollWaits))
	}
	fmt.Fprintln(w)
}

// printBox writes where the box's CPU went.
func printBox(w io.Writer, b *boxSummary) {
	fmt.Fprintf(w, "box:       %.2f of %d cores busy over %.1fs: server %.2f, ", b.BusyCores, b.Cores, b.Seconds, b.ServerCores)
	if b.RedisCores > 0 {
		fmt.Fprintf(w, "redis %.2f, ", b.RedisCores)
	}
	fmt.Fprintf(w, "ssebench %.2f, ksoftirqd %.2f, others %.2f", b.ClientCores, b.SoftirqCores, b.OtherCores)
	if b.StealCores >= 0.005 {
		fmt.Fprintf(w, "; the hypervisor took %.2f (steal)", b.StealCores)
	}
	fmt.Fprintln(w)
}

// printChaos writes one fault of -chaos.
func printChaos(w io.Writer, c chaosEvent) {
	fmt.Fprintf(w, "chaos:     at %.1fs %s", c.AtS, c.Action)
	if c.Target != "" {
		fmt.Fprintf(w, " %s", c.Target)
	}
	if c.DownS > 0 {
		fmt.Fprintf(w, " (%.1fs)", c.DownS)
	}
	if c.Error != "" {
		fmt.Fprintf(w, " FAILED: %s", c.Error)
	}
	fmt.Fprintln(w)
}
