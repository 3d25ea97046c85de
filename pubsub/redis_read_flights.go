package pubsub

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

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
// sent when it lands (or once it is overdue): a read waits at most one
// round trip more, and Redis gets about one read of each distinct question
// per round trip however many streams ask it. (libraryLoads shares a load
// under way instead: a load is the same whenever it ran; a page is not.)
type readFlights struct {
	ask     func(context.Context, readQuestion) readAnswer // reads Redis
	overdue time.Duration                                  // readOverdue; a test's own
	mu      sync.Mutex
	inAir   map[readQuestion]*readFlight // the newest read sent for each question
	asked   atomic.Uint64                // reads asked (BackendStatus)
	sent    atomic.Uint64                // reads sent to Redis
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
	q       readQuestion
	values  context.Context    // the first waiter's, without its cancellation
	cancel  context.CancelFunc // set once sent; cancels it when no one waits
	sentAt  time.Time
	waiters int
	next    *readFlight // not sent yet: boarded by those who came while this one flew
	overdue *time.Timer // sends next if this one has not landed by then
	done    chan struct{}
	answer  readAnswer
}

// readOverdue is how long a read may be in the air before the next is sent
// anyway. A healthy Redis answers in milliseconds; a read on a connection
// Redis no longer answers on ends only at go-redis' read timeout (it does
// not interrupt a read whose context ends), and the streams that ask after
// it must not wait for that.
const readOverdue = time.Second

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
	f.asked.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	fl := f.inAir[q]
	switch {
	case fl == nil:
		fl = newReadFlight(ctx, q)
		f.send(fl)
	case fl.next == nil:
		prev := fl
		fl = newReadFlight(ctx, q)
		prev.next = fl
		prev.overdue = time.AfterFunc(time.Until(prev.sentAt.Add(f.overdue)), func() {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.sendNext(prev)
		})
	default:
		fl = fl.next
	}
	fl.waiters++
	return fl
}

func newReadFlight(ctx context.Context, q readQuestion) *readFlight {
	return &readFlight{q: q, values: context.WithoutCancel(ctx), done: make(chan struct{})}
}

// send sends fl, with f.mu held: its read runs on a goroutine of its own,
// so that a waiter that gives up does not end it for the others. Those
// who ask from now on wait for the one after it.
func (f *readFlights) send(fl *readFlight) {
	var ctx context.Context
	ctx, fl.cancel = context.WithCancel(fl.values)
	fl.sentAt = time.Now()
	f.sent.Add(1)
	if f.inAir == nil {
		f.inAir = make(map[readQuestion]*readFlight)
	}
	f.inAir[fl.q] = fl
	go f.fly(ctx, fl)
}

// sendNext sends the read that follows fl, with f.mu held, if anyone waits
// for it: fl landed, no one waits for it any more, or it is overdue.
func (f *readFlights) sendNext(fl *readFlight) {
	next := fl.next
	fl.next = nil
	if next != nil && next.waiters > 0 {
		f.send(next)
	}
}

// fly reads, hands the answer to fl's waiters and sends the read that
// follows it.
func (f *readFlights) fly(ctx context.Context, fl *readFlight) {
	fl.answer = f.ask(ctx, fl.q)
	fl.cancel()
	f.mu.Lock()
	f.land(fl)
	f.mu.Unlock()
	close(fl.done)
}

// land takes fl out of the air, with f.mu held, and sends the one after it.
func (f *readFlights) land(fl *readFlight) {
	if fl.overdue != nil {
		fl.overdue.Stop()
	}
	if f.inAir[fl.q] == fl {
		delete(f.inAir, fl.q)
	}
	f.sendNext(fl)
}

// leave gives up a seat on fl. A read sent for no one is cancelled, and
// the one after it is sent at once (the cancelled one may linger in
// go-redis); one not sent yet is not sent unless someone boards it again.
func (f *readFlights) leave(fl *readFlight) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fl.waiters--
	if fl.waiters == 0 && fl.cancel != nil {
		fl.cancel()
		f.land(fl)
	}
}
