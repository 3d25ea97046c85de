package caddysse

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A wave of steps (a heartbeat round, an event to every stream) runs on at
// most the pool's workers, not on a goroutine per step.
func TestStepPoolRunsAWaveOnItsWorkers(t *testing.T) {
	p := newStepPool()
	defer p.stop()
	const steps = 2000
	var running, most, ran atomic.Int32
	var wg sync.WaitGroup
	for range steps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.run(func() {
				n := running.Add(1)
				for {
					m := most.Load()
					if n <= m || most.CompareAndSwap(m, n) {
						break
					}
				}
				time.Sleep(100 * time.Microsecond)
				running.Add(-1)
				ran.Add(1)
			})
		}()
	}
	wg.Wait()
	if ran.Load() != steps {
		t.Fatalf("%d of %d steps ran", ran.Load(), steps)
	}
	// a step runs beside the workers only if they made no progress for
	// stuckAfter (a very busy machine)
	if m := most.Load(); int64(m) > int64(p.max)+p.escaped.Load() {
		t.Fatalf("%d steps ran at once; the pool has %d workers (%d steps escaped)", m, p.max, p.escaped.Load())
	}
	if w := p.workers.Load(); w < 1 || w > p.max {
		t.Fatalf("%d workers after the wave, want 1..%d", w, p.max)
	}
}

// Workers blocked by steps that do not end (clients that do not read) do
// not hold up the next step: it gets a goroutine of its own.
func TestStepPoolStepsGoOnWhileWorkersAreStuck(t *testing.T) {
	p := newStepPool()
	release := make(chan struct{})
	defer p.stop()
	defer close(release)
	var stuck sync.WaitGroup
	for range p.max {
		stuck.Add(1)
		go p.run(func() { stuck.Done(); <-release })
	}
	stuck.Wait()
	done := make(chan struct{})
	go p.run(func() { close(done) })
	select {
	case <-done:
		if p.escaped.Load() != 1 {
			t.Fatalf("%d steps escaped, want the one", p.escaped.Load())
		}
	case <-time.After(10 * stuckAfter):
		t.Fatal("a step waited while every worker was stuck")
	}
}

// Steps that wait for workers that go on finishing steps wait for them: a
// wave longer than stuckAfter lets no step go beside the workers.
func TestStepPoolLetsNoStepGoWhileWorkersProgress(t *testing.T) {
	p := newStepPool()
	defer p.stop()
	steps := int(p.max) * 20 // 20 rounds of 5 ms: twice stuckAfter
	var wg sync.WaitGroup
	began := time.Now()
	for range steps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.run(func() { time.Sleep(5 * time.Millisecond) })
		}()
	}
	wg.Wait()
	if n := p.escaped.Load(); n != 0 {
		t.Fatalf("%d steps ran beside the workers while those finished a step every few ms", n)
	}
	if took := time.Since(began); took < 2*stuckAfter {
		t.Fatalf("the wave took %v: too short to test the check", took)
	}
}

func TestStepPoolRaisesAStepsPanicInTheCaller(t *testing.T) {
	for _, p := range []*stepPool{newStepPool(), nil} {
		func() {
			defer func() {
				if r := recover(); r != "boom" {
					t.Fatalf("recovered %v, want the step's panic", r)
				}
			}()
			p.run(func() { panic("boom") })
		}()
		p.stop()
	}
}

// After the handler's Cleanup the workers end, and later steps (streams
// writing their last words) still run.
func TestStepPoolAfterStop(t *testing.T) {
	p := newStepPool()
	p.run(func() {})
	p.stop()
	deadline := time.Now().Add(5 * time.Second)
	for p.workers.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d workers left after stop", p.workers.Load())
		}
		time.Sleep(time.Millisecond)
	}
	ran := false
	p.run(func() { ran = true })
	if !ran {
		t.Fatal("a step after stop did not run")
	}
}
