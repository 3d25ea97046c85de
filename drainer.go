package caddysse

import (
	"context"
	"runtime"
	"sync"
)

// drainer writes every stream no event loop writes — those that keep their
// handler goroutine (stack.go), and the rare HTTP/1.x ones the loops refuse
// or cannot watch — on a few goroutines of its own. A poked stream goes on its ready queue
// and the next free worker drains it; the handler goroutine only waits for
// the stream's end. A goroutine per stream woken for each event would cost
// a wake-up and a hand-off per delivery, and writing on the handler
// goroutine grows its stack to 16 KiB for the stream's life.
//
// A step that may wait for long runs on a goroutine of its own: a stream
// told to close (its lease removal may wait for Redis), or catching up from
// the history (degraded, or after an overflow). A write that blocks (a
// client that stopped reading, up to slow_client_timeout) holds a worker:
// when the workers make no progress for stuckAfter while streams wait,
// more are started, which end once the queue is empty.
type drainer struct {
	mu      sync.Mutex
	ready   []drainable // the queue: ready[head:]
	head    int
	waiting int // workers waiting for work
	workers int
	wakeup  *sync.Cond
	stopped bool
	stuck   stuckCheck // armed while streams wait (watch)
	// taken counts the streams the workers took: unchanged for stuckAfter
	// while streams wait, every worker is held by a step. (Counted under
	// mu, which taking holds anyway, not in a word the workers would pass
	// between cores at every step.)
	taken int64
	base  int // workers kept while the drainer runs
}

// drainable is what the drainer writes: a stream (tests give it others).
type drainable interface {
	// drainState and setDrainState hold its state in the drainer (serve
	// sets it).
	drainState() *drained
	setDrainState(*drained)
	// mayWait tells whether its next step may wait for long.
	mayWait() bool
	// writeStep writes what it has to write; ended reports its end.
	writeStep(ctx context.Context) (ended bool, err error)
}

// drained is a pooled stream's state in the drainer.
type drained struct {
	ctx     context.Context
	mu      sync.Mutex
	queued  bool // on the ready queue
	running bool // a step is being written
	again   bool // poked while it ran: queue it again after
	stopped bool // its handler goroutine is gone or going: run no step
	// done receives the stream's end: its error, or a step's panic.
	done chan drainEnd
	// idle, when set, is closed once no step runs (stop waits for it).
	idle chan struct{}
}

type drainEnd struct {
	err      error
	panicked any
}

func newDrainer() *drainer {
	d := &drainer{base: runtime.GOMAXPROCS(0)}
	d.wakeup = sync.NewCond(&d.mu)
	return d
}

// serve drains s on the drainer until it ends or ctx ends, and returns
// its error (nil if the client left). A step's panic is raised again here.
func (d *drainer) serve(ctx context.Context, s drainable) error {
	st := &drained{ctx: ctx, done: make(chan drainEnd, 1)}
	s.setDrainState(st)
	d.schedule(s) // events may have been queued before
	var end drainEnd
	select {
	case end = <-st.done:
	case <-ctx.Done():
		// the client left; a step that was running may have ended the
		// stream meanwhile (a write cut off as a slow client's, which
		// net/http noticed first): its end is what happened
		st.stop()
		select {
		case end = <-st.done:
		default:
		}
	}
	if end.panicked != nil {
		panic(end.panicked)
	}
	return end.err
}

// stop makes the drainer run no more steps of the stream, and waits for
// the one running, if any: the response must not be written once its
// handler returns.
func (st *drained) stop() {
	st.mu.Lock()
	st.stopped = true
	if !st.running {
		st.mu.Unlock()
		return
	}
	st.idle = make(chan struct{})
	idle := st.idle
	st.mu.Unlock()
	<-idle
}

// schedule queues s to be drained, unless it is queued or stopped; a
// stream being drained is queued again once its step is done.
func (d *drainer) schedule(s drainable) {
	st := s.drainState()
	st.mu.Lock()
	switch {
	case st.stopped || st.queued:
		st.mu.Unlock()
		return
	case st.running:
		st.again = true
		st.mu.Unlock()
		return
	}
	st.queued = true
	st.mu.Unlock()
	d.push(s)
}

func (d *drainer) push(s drainable) {
	d.mu.Lock()
	if d.stopped {
		d.mu.Unlock()
		go d.runOnce(s) // the handler is cleaned up: its streams are closing
		return
	}
	d.ready = append(d.ready, s)
	signal := d.waiting > 0
	if !signal && d.workers < d.base {
		d.workers++
		go d.work(true)
	}
	// even a worker woken for it may take another stream first and block
	// on its write: whatever waits in the queue is watched
	d.watch()
	d.mu.Unlock()
	if signal {
		d.wakeup.Signal() // after unlocking: the worker woken takes the lock at once
	}
}

// watch arms a check for stuck workers, if none is armed (d.mu held).
func (d *drainer) watch() { d.stuck.arm(d.taken, d.checkStuck) }

// checkStuck starts more workers if streams wait and the workers made no
// progress since seen: their writes block (clients that do not read).
func (d *drainer) checkStuck(seen int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stuck.fired()
	waiting := len(d.ready) - d.head
	if waiting == 0 || d.stopped {
		return
	}
	if d.taken == seen {
		for range min(waiting, stuckWorkers) {
			d.workers++
			go d.work(false)
		}
	}
	d.watch()
}

// stuckWorkers is how many workers a check for stuck ones starts at most.
const stuckWorkers = 64

// work drains ready streams; a kept worker waits for more, another ends
// once the queue is empty. All end when the drainer stops.
func (d *drainer) work(kept bool) {
	for {
		s := d.take(kept)
		if s == nil {
			return
		}
		d.runOnce(s)
	}
}

// take returns the next ready stream, waiting for one if kept; nil when
// the worker should end.
func (d *drainer) take(kept bool) drainable {
	d.mu.Lock()
	defer d.mu.Unlock()
	for d.head == len(d.ready) {
		if !kept || d.stopped {
			d.workers--
			return nil
		}
		d.waiting++
		d.wakeup.Wait()
		d.waiting--
	}
	s := d.ready[d.head]
	d.ready[d.head] = nil
	d.head++
	d.taken++
	switch {
	case d.head == len(d.ready):
		d.ready, d.head = d.ready[:0], 0
	case d.head > 1024 && d.head > len(d.ready)/2: // a queue never empty: reuse its front
		n := copy(d.ready, d.ready[d.head:])
		clear(d.ready[n:])
		d.ready, d.head = d.ready[:n], 0
	}
	return s
}

// runOnce runs one step of s, unless it was stopped meanwhile. A step
// that may wait for long gets a goroutine of its own.
func (d *drainer) runOnce(s drainable) {
	st := s.drainState()
	st.mu.Lock()
	st.queued = false
	if st.stopped {
		st.mu.Unlock()
		return
	}
	st.running = true
	st.mu.Unlock()
	if s.mayWait() {
		go d.step(s, st)
		return
	}
	d.step(s, st)
}

// step writes what the stream has to write, then queues it again if it
// was poked meanwhile, or hands its end to its handler goroutine.
func (d *drainer) step(s drainable, st *drained) {
	var end *drainEnd
	func() {
		defer func() {
			if r := recover(); r != nil {
				end = &drainEnd{panicked: r}
			}
		}()
		if ended, err := s.writeStep(st.ctx); ended {
			end = &drainEnd{err: err}
		}
	}()
	st.mu.Lock()
	st.running = false
	again := st.again && !st.stopped && end == nil
	st.again = false
	if end != nil {
		st.stopped = true
		// before idle is closed: a stop that waited for this step then
		// finds the end (a slow client's, say) instead of losing it. The
		// channel holds the one end a stream has.
		st.done <- *end
	}
	if st.idle != nil {
		close(st.idle)
		st.idle = nil
	}
	if again {
		st.queued = true
	}
	st.mu.Unlock()
	if again {
		d.push(s)
	}
}

// stop ends the waiting workers; streams poked later are stepped on
// goroutines of their own (they are being told to close).
func (d *drainer) stop() {
	if d == nil {
		return
	}
	d.mu.Lock()
	d.stopped = true
	ready := d.ready[d.head:]
	d.ready, d.head = nil, 0
	d.wakeup.Broadcast()
	d.mu.Unlock()
	for _, s := range ready {
		go d.runOnce(s)
	}
}

func (s *stream) drainState() *drained      { return s.pooled.Load() }
func (s *stream) setDrainState(st *drained) { s.pooled.Store(st) }

// mayWait tells whether the stream's next step may wait for long: it is
// told to close (its lease removal may wait for Redis), or it catches up
// from the history.
func (s *stream) mayWait() bool {
	return s.closing.Load() != nil || s.degraded.Load() || s.overflowSince.Load() != 0
}
