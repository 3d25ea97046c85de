package caddysse

import (
	"runtime"
	"sync/atomic"
	"time"
)

// stepPool runs the steps of streams that keep their handler goroutine
// (stack.go) on a few goroutines it keeps, instead of a new goroutine per
// step. Steps come in waves: a heartbeat round or an event reaches every
// stream at once. With a goroutine per step, 10k HTTP/2 streams made 10k
// goroutines at once, each with an 8 KiB stack that the runtime kept after
// it ended until its next collection, which an idle server runs every two
// minutes: an idle HTTP/2 stream's memory rose from 23.7 KiB after the
// ramp to 32.3 KiB two minutes later. Here a wave waits for the workers.
//
// A step may block for long (a write to a client that does not read, up to
// the slow-client timeout). When no worker has started or finished a step
// for stuckAfter, a waiting step gets a goroutine of its own, so that stalled
// clients cannot hold up everyone else's steps.
type stepPool struct {
	jobs     chan *stepJob
	quit     chan struct{}
	workers  atomic.Int32
	max      int32
	progress atomic.Int64 // when a worker last started or finished a step, Unix ns
	escaped  atomic.Int64 // steps that ran on a goroutine of their own while workers were stuck
}

type stepJob struct {
	f    func()
	done chan any // the step's panic, or nil
}

const (
	// stuckAfter is how long waiting steps let the workers make no
	// progress before one of them runs on a goroutine of its own.
	stuckAfter = 50 * time.Millisecond
	// workerIdle is how long a worker waits for a step before it ends.
	workerIdle = 10 * time.Second
)

func newStepPool() *stepPool {
	p := &stepPool{
		jobs: make(chan *stepJob),
		quit: make(chan struct{}),
		max:  int32(16 * runtime.GOMAXPROCS(0)),
	}
	p.progress.Store(time.Now().UnixNano())
	return p
}

// run runs f on a worker and waits for it; a panic in f is raised again
// here, where net/http recovers it as it would have. Without a pool (a
// handler that was not provisioned) f gets a goroutine of its own.
func (p *stepPool) run(f func()) {
	job := &stepJob{f: f, done: make(chan any, 1)}
	if p == nil {
		go job.run()
	} else {
		p.submit(job)
	}
	if r := <-job.done; r != nil {
		panic(r)
	}
}

func (job *stepJob) run() {
	defer func() { job.done <- recover() }()
	job.f()
}

func (p *stepPool) submit(job *stepJob) {
	select {
	case p.jobs <- job: // an idle worker took it
		return
	case <-p.quit:
		go job.run() // the handler is cleaned up: no workers wait
		return
	default:
	}
	if p.grow() {
		go p.work(job)
		return
	}
	tick := time.NewTicker(stuckAfter)
	defer tick.Stop()
	for {
		select {
		case p.jobs <- job:
			return
		case <-p.quit:
			go job.run()
			return
		case <-tick.C:
			if time.Since(time.Unix(0, p.progress.Load())) >= stuckAfter {
				p.escaped.Add(1)
				go job.run()
				return
			}
		}
	}
}

// grow counts a new worker if there is room for one.
func (p *stepPool) grow() bool {
	for {
		n := p.workers.Load()
		if n >= p.max {
			return false
		}
		if p.workers.CompareAndSwap(n, n+1) {
			p.progress.Store(time.Now().UnixNano())
			return true
		}
	}
}

// work runs job and then the steps handed to it, until it has waited for
// one for workerIdle or the pool is stopped.
func (p *stepPool) work(job *stepJob) {
	defer p.workers.Add(-1)
	idle := time.NewTimer(workerIdle)
	defer idle.Stop()
	for {
		job.run()
		p.progress.Store(time.Now().UnixNano())
		idle.Reset(workerIdle)
		select {
		case job = <-p.jobs:
		case <-idle.C:
			return
		case <-p.quit:
			return
		}
	}
}

// stop makes the workers end once their step is done; steps submitted
// later get goroutines of their own.
func (p *stepPool) stop() {
	if p != nil {
		close(p.quit)
	}
}
