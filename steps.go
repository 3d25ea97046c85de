package caddysse

import (
	"runtime"
	"sync"
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
// for stuckAfter while steps wait, the waiting steps get goroutines of their
// own, so that stalled clients cannot hold up everyone else's steps. One
// check (a timer) serves all the steps waiting at once: a ticker for each,
// in a wave of 10k stream starts, left the runtime's timer heaps grown by
// about 175 bytes per stream for good.
type stepPool struct {
	jobs     chan *stepJob
	quit     chan struct{}
	workers  atomic.Int32
	max      int32
	progress atomic.Int64 // steps the workers started or finished
	escaped  atomic.Int64 // steps that ran on a goroutine of their own while workers were stuck

	mu sync.Mutex
	// stuck is closed once the workers made no progress for stuckAfter
	// while steps waited (checkStuck); nil while no step waits.
	stuck   chan struct{}
	waiting int // steps waiting for a worker
	check   stuckCheck
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
	stuck := p.wait()
	defer p.waited()
	select {
	case p.jobs <- job:
	case <-p.quit:
		go job.run()
	case <-stuck:
		p.escaped.Add(1)
		go job.run()
	}
}

// wait counts a step that waits for a worker and returns the channel closed
// if the workers are stuck, arming the check if it is the first to wait.
func (p *stepPool) wait() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.waiting++
	if p.stuck == nil {
		p.stuck = make(chan struct{})
		p.watch()
	}
	return p.stuck
}

func (p *stepPool) waited() {
	p.mu.Lock()
	p.waiting--
	p.mu.Unlock()
}

// watch arms the check for stuck workers (p.mu held).
func (p *stepPool) watch() { p.check.arm(p.progress.Load(), p.checkStuck) }

// checkStuck lets the waiting steps go if the workers made no progress
// since seen, and checks again later while steps still wait.
func (p *stepPool) checkStuck(seen int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.check.fired()
	switch {
	case p.waiting == 0:
		p.stuck = nil
	case p.progress.Load() == seen:
		close(p.stuck)
		p.stuck = nil
	default:
		p.watch()
	}
}

// stuckCheck is the check for stuck workers that the step pool and the
// drainer share: one timer for all the work waiting at once, armed by the
// first to wait, which hands its owner the workers' progress count from
// when it was armed; the owner compares it with the count then, lets the
// waiting work go if it has not moved, and arms it again while work waits.
// Its owner's lock guards it.
type stuckCheck struct{ armed bool }

// arm schedules check(progress) stuckAfter from now, unless one is due.
func (c *stuckCheck) arm(progress int64, check func(seen int64)) {
	if c.armed {
		return
	}
	c.armed = true
	time.AfterFunc(stuckAfter, func() { check(progress) })
}

// fired is called first by the check, its owner's lock held.
func (c *stuckCheck) fired() { c.armed = false }

// grow counts a new worker if there is room for one.
func (p *stepPool) grow() bool {
	for {
		n := p.workers.Load()
		if n >= p.max {
			return false
		}
		if p.workers.CompareAndSwap(n, n+1) {
			p.progress.Add(1)
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
		p.progress.Add(1)
		job.run()
		p.progress.Add(1)
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
