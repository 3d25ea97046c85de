package pubsub

import (
	"context"
	"sync"

	"github.com/caddy-sse/caddy-sse/replay"
)

// readFlights sends Redis one read of a channel's history for all the
// streams that ask the same question at once. After a reload or a restart
// every client of a channel reconnects within close_jitter, most from the
// same Last-Event-ID, and each stream's replay was a read of its own: 10k
// reads of the same page, each a function call that costs Redis some 100 µs
// of its one thread while publishes wait behind them.
//
// A read never joins one already sent: the page it gets must hold every
// event published before it asked (the stream subscribed before reading,
// so an event missing from the page would reach it only with the next
// one). Those that ask while a read is in the air share the next one,
// sent when it lands: a read waits at most one round trip more, and Redis
// answers each distinct question at most twice per round trip however many
// streams ask it.
type readFlights struct {
	ask   func(context.Context, readQuestion) readAnswer // reads Redis
	mu    sync.Mutex
	inAir map[readQuestion]*readFlight // the read sent for each question
}

// readQuestion is what a read asks: the events of a key after a position
// (or only its head), at most limit.
type readQuestion struct {
	key   string
	after replay.Position
	head  bool // no position: the head only
	limit int
}

func newReadQuestion(key string, after *replay.Position, limit int) readQuestion {
	if after == nil {
		return readQuestion{key: key, head: true, limit: limit}
	}
	return readQuestion{key: key, after: *after, limit: limit}
}

// position is the position q reads after (nil: the head only).
func (q readQuestion) position() *replay.Position {
	if q.head {
		return nil
	}
	return &q.after
}

// readAnswer is what a read of the history returns.
type readAnswer struct {
	page replay.Page
	bad  int
	err  error
}

// readFlight is one read sent (or to be sent) for its waiters. Its answer
// is theirs to share: pages are read-only.
type readFlight struct {
	values  context.Context    // the first waiter's, without its cancellation
	cancel  context.CancelFunc // set once sent; cancels it when no one waits
	waiters int
	next    *readFlight // boarded by those who came while this one flew
	done    chan struct{}
	answer  readAnswer
}

// read answers q, shared with those who ask q at the same time.
func (f *readFlights) read(ctx context.Context, q readQuestion) readAnswer {
	fl := f.board(ctx, q)
	select {
	case <-fl.done:
		return fl.answer
	case <-ctx.Done():
		f.leave(fl)
		return readAnswer{err: ctx.Err()}
	}
}

// board takes a seat on the next read of q to be sent: a new one, sent at
// once, if none is in the air, or the one to follow it.
func (f *readFlights) board(ctx context.Context, q readQuestion) *readFlight {
	f.mu.Lock()
	defer f.mu.Unlock()
	fl := f.inAir[q]
	if fl == nil {
		fl = newReadFlight(ctx)
		if f.inAir == nil {
			f.inAir = make(map[readQuestion]*readFlight)
		}
		f.inAir[q] = fl
		f.send(q, fl)
	} else {
		if fl.next == nil {
			fl.next = newReadFlight(ctx)
		}
		fl = fl.next
	}
	fl.waiters++
	return fl
}

func newReadFlight(ctx context.Context) *readFlight {
	return &readFlight{values: context.WithoutCancel(ctx), done: make(chan struct{})}
}

// send sends fl, with f.mu held: its read runs on a goroutine of its own,
// so that a waiter that gives up does not end it for the others.
func (f *readFlights) send(q readQuestion, fl *readFlight) {
	var ctx context.Context
	ctx, fl.cancel = context.WithCancel(fl.values)
	go f.fly(ctx, q, fl)
}

// fly reads, hands the answer to fl's waiters and sends the read that
// follows it, if anyone still waits for that one.
func (f *readFlights) fly(ctx context.Context, q readQuestion, fl *readFlight) {
	fl.answer = f.ask(ctx, q)
	fl.cancel()
	f.mu.Lock()
	if next := fl.next; next != nil && next.waiters > 0 {
		f.inAir[q] = next
		f.send(q, next)
	} else {
		delete(f.inAir, q)
	}
	f.mu.Unlock()
	close(fl.done)
}

// leave gives up a seat on fl; a read sent for no one is cancelled, one not
// sent yet is not sent.
func (f *readFlights) leave(fl *readFlight) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fl.waiters--
	if fl.waiters == 0 && fl.cancel != nil {
		fl.cancel()
	}
}
