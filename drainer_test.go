package caddysse

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeDrainable counts its steps; each step runs step if set.
type fakeDrainable struct {
	st    atomic.Pointer[drained]
	steps atomic.Int32
	step  func(n int32) (bool, error)
	wait  bool
}

func (f *fakeDrainable) drainState() *drained      { return f.st.Load() }
func (f *fakeDrainable) setDrainState(st *drained) { f.st.Store(st) }
func (f *fakeDrainable) mayWait() bool             { return f.wait }
func (f *fakeDrainable) writeStep(context.Context) (bool, error) {
	n := f.steps.Add(1)
	if f.step != nil {
		return f.step(n)
	}
	return false, nil
}

// serveInBackground serves f on d and returns its end.
func serveInBackground(ctx context.Context, d *drainer, f *fakeDrainable) <-chan error {
	ended := make(chan error, 1)
	go func() { ended <- d.serve(ctx, f) }()
	for f.drainState() == nil {
		time.Sleep(time.Millisecond)
	}
	return ended
}

// A stream poked while its step runs gets another step: no wake-up is lost.
func TestDrainerStepsAgainAStreamPokedWhileItRan(t *testing.T) {
	d := newDrainer()
	defer d.stop()
	inStep, release := make(chan struct{}), make(chan struct{})
	f := &fakeDrainable{}
	f.step = func(n int32) (bool, error) {
		if n == 2 {
			close(inStep)
			<-release
		}
		return false, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := serveInBackground(ctx, d, f)
	eventually(t, "the first step", func() bool { return f.steps.Load() == 1 })
	d.schedule(f)
	<-inStep
	d.schedule(f) // while step 2 runs
	close(release)
	eventually(t, "the step after the poke", func() bool { return f.steps.Load() == 3 })
	cancel()
	if err := <-ended; err != nil {
		t.Fatalf("serve returned %v after its context ended, want nil", err)
	}
}

// The handler goroutine returns only once the running step is done: the
// response must not be written after its handler returned.
func TestDrainerStopWaitsForTheRunningStep(t *testing.T) {
	d := newDrainer()
	defer d.stop()
	inStep, release := make(chan struct{}), make(chan struct{})
	var stepDone atomic.Bool
	f := &fakeDrainable{}
	f.step = func(int32) (bool, error) {
		close(inStep)
		<-release
		stepDone.Store(true)
		return false, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := serveInBackground(ctx, d, f)
	<-inStep
	cancel()
	select {
	case <-ended:
		t.Fatal("serve returned while a step was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-ended
	if !stepDone.Load() {
		t.Fatal("serve returned before the step was done")
	}
	d.schedule(f)
	time.Sleep(20 * time.Millisecond)
	if n := f.steps.Load(); n != 1 {
		t.Fatalf("%d steps, want none after the stream stopped", n)
	}
}

func TestDrainerReturnsAStreamsEndAndRaisesAStepsPanic(t *testing.T) {
	d := newDrainer()
	defer d.stop()
	boom := errors.New("write failed")
	f := &fakeDrainable{step: func(int32) (bool, error) { return true, boom }}
	if err := d.serve(context.Background(), f); !errors.Is(err, boom) {
		t.Fatalf("serve returned %v, want the step's error", err)
	}
	p := &fakeDrainable{step: func(int32) (bool, error) { panic("boom") }}
	defer func() {
		if r := recover(); r != "boom" {
			t.Fatalf("recovered %v, want the step's panic", r)
		}
	}()
	_ = d.serve(context.Background(), p)
	t.Fatal("serve returned after a step panicked")
}

// Workers blocked by writes that do not end (clients that do not read) do
// not hold up the other streams: more workers start.
func TestDrainerStartsWorkersWhileTheOthersAreStuck(t *testing.T) {
	d := newDrainer()
	release := make(chan struct{})
	defer d.stop()
	defer close(release)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stuck sync.WaitGroup
	for range d.base {
		stuck.Add(1)
		f := &fakeDrainable{step: func(int32) (bool, error) { stuck.Done(); <-release; return false, nil }}
		serveInBackground(ctx, d, f)
	}
	stuck.Wait()
	f := &fakeDrainable{}
	serveInBackground(ctx, d, f)
	eventually(t, "a step while every worker is stuck", func() bool { return f.steps.Load() == 1 })
}

// A step that may wait for long (a stream told to close) runs beside the
// workers, which go on with the others.
func TestDrainerRunsAStepThatMayWaitOnItsOwnGoroutine(t *testing.T) {
	d := newDrainer()
	defer d.stop()
	release := make(chan struct{})
	defer close(release)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range d.base * 4 {
		waits := &fakeDrainable{wait: true, step: func(int32) (bool, error) { <-release; return true, nil }}
		serveInBackground(ctx, d, waits)
	}
	f := &fakeDrainable{}
	start := time.Now()
	serveInBackground(ctx, d, f)
	eventually(t, "the other stream's step", func() bool { return f.steps.Load() == 1 })
	if took := time.Since(start); took >= stuckAfter {
		t.Fatalf("the other stream waited %v: as long as the check for stuck workers", took)
	}
}

// Streams poked after the drainer stopped (told to close by Cleanup) are
// still written.
func TestDrainerStepsStreamsPokedAfterItStopped(t *testing.T) {
	d := newDrainer()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := &fakeDrainable{}
	serveInBackground(ctx, d, f)
	eventually(t, "the first step", func() bool { return f.steps.Load() == 1 })
	d.stop()
	d.schedule(f)
	eventually(t, "a step after stop", func() bool { return f.steps.Load() == 2 })
}

// A step that ends the stream while its client leaves (a slow client's
// write cut off, which net/http notices too) reports that end: the stream
// is counted and throttled as a slow client's. The step's end was sent
// after the stop waiting for the step was let go: a stop that looked for
// it at once lost it now and then (seen on a loaded box), so this runs it
// many times.
func TestDrainerReportsTheEndOfAStepThatRanWhenTheClientLeft(t *testing.T) {
	d := newDrainer()
	defer d.stop()
	boom := errors.New("slow client")
	for range 100 {
		inStep, release := make(chan struct{}), make(chan struct{})
		f := &fakeDrainable{step: func(int32) (bool, error) {
			close(inStep)
			<-release
			return true, boom
		}}
		ctx, cancel := context.WithCancel(context.Background())
		ended := serveInBackground(ctx, d, f)
		<-inStep
		cancel()
		eventually(t, "serve to wait for the step", func() bool {
			st := f.drainState()
			st.mu.Lock()
			defer st.mu.Unlock()
			return st.idle != nil
		})
		close(release)
		if err := <-ended; !errors.Is(err, boom) {
			t.Fatalf("serve returned %v, want the step's end", err)
		}
	}
}

// A worker woken for a stream may take one queued before it and block on
// its write: the stream left in the queue still gets a worker.
func TestDrainerStreamBehindABlockedWorkerGetsAnother(t *testing.T) {
	d := newDrainer()
	d.base = 1
	defer d.stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := &fakeDrainable{}
	serveInBackground(ctx, d, first)
	eventually(t, "the first step", func() bool { return first.steps.Load() == 1 })
	eventually(t, "the worker waiting", func() bool { d.mu.Lock(); defer d.mu.Unlock(); return d.waiting == 1 })
	release := make(chan struct{})
	defer close(release)
	blocks := &fakeDrainable{step: func(int32) (bool, error) { <-release; return false, nil }}
	behind := &fakeDrainable{}
	for _, f := range []*fakeDrainable{blocks, behind} {
		f.setDrainState(&drained{ctx: ctx, done: make(chan drainEnd, 1)})
	}
	d.schedule(blocks) // both while the worker has not woken yet
	d.schedule(behind)
	eventually(t, "the step behind the blocked one", func() bool { return behind.steps.Load() == 1 })
}
