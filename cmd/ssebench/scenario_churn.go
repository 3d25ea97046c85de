package main

import (
	"fmt"
	"math"
	"syscall"
	"time"
)

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
