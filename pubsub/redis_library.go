package pubsub

import (
	"context"
	"sync"
	"time"
)

// libraryLoads runs one load of the library per node at a time. On a fresh
// or flushed Redis every call of a burst of new connections finds the
// library missing; each FUNCTION LOAD compiles the library and blocks Redis
// while it does (about 0.1 ms), and hundreds of them in a row held up the
// very calls that waited for them. A call that finds a load of its node
// under way waits for that load instead of starting another.
type libraryLoads struct {
	mu       sync.Mutex
	inFlight map[string]*libraryLoad // by node address
}

type libraryLoad struct {
	done    chan struct{}
	err     error
	waiting int // callers waiting for it (under libraryLoads.mu; tests wait for them)
}

// libraryLoadTimeout bounds a load that callers share: it does not end
// with the context of the call that happened to start it.
const libraryLoadTimeout = 10 * time.Second

// do runs load for the node at addr, or waits for the load of that node
// already under way and returns its result.
func (l *libraryLoads) do(ctx context.Context, addr string, load func(context.Context) error) error {
	l.mu.Lock()
	if running, ok := l.inFlight[addr]; ok {
		running.waiting++
		l.mu.Unlock()
		select {
		case <-running.done:
			return running.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	mine := &libraryLoad{done: make(chan struct{})}
	if l.inFlight == nil {
		l.inFlight = make(map[string]*libraryLoad)
	}
	l.inFlight[addr] = mine
	l.mu.Unlock()

	shared, cancel := context.WithTimeout(context.WithoutCancel(ctx), libraryLoadTimeout)
	mine.err = load(shared)
	cancel()
	l.mu.Lock()
	delete(l.inFlight, addr)
	l.mu.Unlock()
	close(mine.done)
	return mine.err
}
