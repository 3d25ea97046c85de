package pubsub

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// lostReplyConn lets its first call of the lease script (or of what the
// hook's match names) reach Redis, then loses the reply (the connection
// drops): Redis ran the call, the client never learns it, and go-redis
// sends the call again on a new connection.
type lostReplyConn struct {
	net.Conn
	armed *atomic.Bool // shared by every connection: one reply is lost in all
	match func([]byte) bool
	lose  bool // this connection's next read loses its reply
}

func isLeaseCall(p []byte) bool {
	return bytes.Contains(p, []byte("lease:{")) && (bytes.Contains(p, []byte("EVALSHA")) || bytes.Contains(p, []byte("evalsha")))
}

func (c *lostReplyConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if c.match(p) && c.armed.CompareAndSwap(true, false) {
		c.lose = true
	}
	return n, err
}

func (c *lostReplyConn) Read(p []byte) (int, error) {
	if c.lose {
		time.Sleep(100 * time.Millisecond) // Redis has run the script by now
		_ = c.Conn.Close()
		return 0, io.EOF
	}
	return c.Conn.Read(p)
}

type loseOneReply struct {
	passThrough
	armed atomic.Bool
	match func([]byte) bool // the call whose reply is lost; the lease script's if nil
}

func (h *loseOneReply) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		match := h.match
		if match == nil {
			match = isLeaseCall
		}
		return &lostReplyConn{Conn: conn, armed: &h.armed, match: match}, nil
	}
}

// An Acquire whose reply is lost after Redis ran it (a dropped connection)
// is sent again by go-redis (max_retries). The call again must not count
// the lease its first run took: a principal holding nothing would be
// refused (and the orphan lease, never renewed nor released, would hold
// its slot for lease_ttl).
func TestRedisLeaseAcquireRetriedAfterALostReplyIsNotRefused(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	hook := &loseOneReply{}
	b.client.AddHook(hook)
	r := NewRedisLeases(b)
	defer r.Close()
	ctx := context.Background()
	// load the script and warm the pool first
	if _, err := r.Acquire(ctx, "warm", 1, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	hook.armed.Store(true)
	_, err := r.Acquire(ctx, "p", 1, 5*time.Second)
	if hook.armed.Load() {
		t.Fatal("the test lost no reply")
	}
	if err != nil {
		t.Fatalf("the first lease of a principal holding none, for a cap of 1: %v (key holds %s members)",
			err, srv.MustCLI("ZCARD", "sse:lease:{p}"))
	}
	counts, err := r.Counts(ctx, []string{"p"})
	if err != nil || counts["p"] != 1 {
		t.Fatalf("the principal holds %v leases (%v), want 1", counts["p"], err)
	}
}

// A lease Redis lost (a restart without persistence, or a failover that lost
// the write) while its stream is still open must still count: otherwise the
// principal is let in beyond its cap until the next renewal (a third of
// lease_ttl, 5 s by default), and the renewal then puts the lost lease back
// beside the new one, for as long as both streams last.
func TestRedisLeaseLostByARestartStillCounts(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ctx := context.Background()
	const ttl = 15 * time.Second // renewed every 5 s
	if _, err := r.Acquire(ctx, "p", 1, ttl); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	srv.Restart() // persistence off: the lease is gone, its stream is not
	var err error
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, err = r.Acquire(ctx, "p", 1, ttl)
		if !errors.Is(err, ErrUnavailable) || time.Now().After(deadline) {
			break
		}
	}
	if !errors.Is(err, ErrLimitReached) {
		time.Sleep(ttl/3 + time.Second) // the renewal puts the lost lease back
		counts, _ := r.Counts(ctx, []string{"p"})
		t.Fatalf("a second lease for a cap of 1 right after Redis lost the first: %v, want ErrLimitReached; after the next renewal the principal holds %d leases", err, counts["p"])
	}
}

// beforeLeaseCall runs before, once armed, before the next call of the
// lease script reaches Redis (after its Acquire listed the leases held),
// and after, once it is answered.
type beforeLeaseCall struct {
	passThrough
	armed         atomic.Bool
	before, after func()
}

func (h *beforeLeaseCall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := cmd.Name()
		if (name != "evalsha" && name != "eval") || !h.armed.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		h.before()
		err := next(ctx, cmd)
		h.after()
		return err
	}
}

// A lease released, and removed from Redis, while an Acquire of its
// principal on the same instance is on its way (it listed the lease among
// those held, to put them back if Redis lost them) is not counted against
// that Acquire: a stream of a principal at its cap ends (a reload tells
// every stream to reconnect, a client closes a tab) while another of its
// streams starts, and the new one was refused with 429 — which makes a
// browser's EventSource give up for good — though the principal held fewer
// streams than its cap. Nor does ReleaseThen call back before the removal
// that follows that Acquire's put-back: the stream would tell its client
// to reconnect while Redis counts its lease again.
func TestRedisLeaseReleasedDuringAnAcquireIsNotPutBack(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	hook := &beforeLeaseCall{}
	b.client.AddHook(hook)
	r := NewRedisLeases(b)
	defer r.Close()
	ctx := context.Background()
	acquireN(t, r, "p", 1, 2) // held throughout
	old := acquireN(t, r, "p", 1, 2)[0].(*redisLease)
	gone := make(chan string, 1)
	flushed := func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return old.flushed
	}
	hook.before = func() {
		old.ReleaseThen(func() { gone <- srv.MustCLI("ZSCORE", "sse:lease:{p}", old.member) })
		// its removal has run (the one that takes it from Redis first)
		pollUntil(t, "the release to be removed from Redis", func() bool {
			r.mu.Lock()
			done := r.removing == nil && len(r.released) == 0
			r.mu.Unlock()
			return done && srv.MustCLI("ZSCORE", "sse:lease:{p}", old.member) == ""
		})
	}
	calledBackEarly := false
	hook.after = func() { calledBackEarly = flushed() }
	hook.armed.Store(true)
	_, err := r.Acquire(ctx, "p", 2, 15*time.Second)
	if hook.armed.Load() {
		t.Fatal("the hook never ran")
	}
	if err != nil {
		t.Errorf("a second lease for a cap of 2 while one other is held: %v", err)
	}
	if calledBackEarly {
		t.Error("the released lease counted as removed while an Acquire that may put it back was on its way")
	}
	select {
	case score := <-gone:
		if score != "" {
			t.Errorf("called back while Redis still holds the lease (score %q)", score)
		}
	case <-time.After(redisWait):
		t.Error("never called back")
	}
}

// lateReply, once armed, lets the next call of the lease script run in
// Redis and then fails it as a call whose reply came too late does (the
// admission's deadline, or the client gone).
type lateReply struct {
	passThrough
	armed atomic.Bool
}

func (h *lateReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := cmd.Name()
		if (name != "evalsha" && name != "eval") || !h.armed.Load() {
			return next(ctx, cmd)
		}
		if err := next(ctx, cmd); err != nil || !h.armed.CompareAndSwap(true, false) {
			return err // NOSCRIPT: go-redis sends it again with EVAL
		}
		cmd.SetErr(context.DeadlineExceeded)
		return context.DeadlineExceeded
	}
}

// An Acquire that fails after Redis ran it (its reply came after the
// admission's deadline, or its client left) took a lease that no stream
// holds, never renewed nor released: the principal was one stream short
// of its cap on every instance for lease_ttl (15 s by default) — and the
// stream itself was admitted without a lease (caps fail open). The lease
// is removed as a released one is.
func TestRedisLeaseOfAFailedAcquireIsRemoved(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	hook := &lateReply{}
	b.client.AddHook(hook)
	r := NewRedisLeases(b)
	defer r.Close()
	ctx := context.Background()
	const ttl = 15 * time.Second
	for _, held := range []int{0, 1} { // the first Acquire of the instance, and one while it holds a lease
		t.Run(strconv.Itoa(held)+" held", func(t *testing.T) {
			principal := "p" + strconv.Itoa(held)
			acquireN(t, r, principal, held, 0)
			hook.armed.Store(true)
			if _, err := r.Acquire(ctx, principal, held+1, ttl); err == nil {
				t.Fatal("the Acquire whose reply came late succeeded")
			}
			if hook.armed.Load() {
				t.Fatal("the hook never ran")
			}
			key := "sse:lease:{" + principal + "}"
			for deadline := time.Now().Add(ttl / 3); srv.MustCLI("ZCARD", key) != strconv.Itoa(held); time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("Redis holds %s leases of the principal, want %d (the one no stream holds counts until it lapses; the key expires in %s ms)",
						srv.MustCLI("ZCARD", key), held, srv.MustCLI("PTTL", key))
				}
			}
		})
	}
}

// A lease Redis lost while it was away (here a restart without
// persistence) is put back as soon as the instance finds Redis answering
// again, not at the next renewal, up to a third of lease_ttl later: until
// then other instances admitted the principal past its cap.
func TestRedisLeaseLostWhileRedisWasAwayIsPutBackWhenItAnswers(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	r := NewRedisLeases(b)
	defer r.Close()
	ctx := context.Background()
	const ttl = 60 * time.Second // renewed every 20 s: longer than the test waits
	if _, err := r.Acquire(ctx, "p", 1, ttl); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	if _, err := r.Acquire(ctx, "q", 1, ttl); !errors.Is(err, ErrUnavailable) { // the instance finds Redis down
		t.Fatalf("an Acquire while Redis is down: %v, want ErrUnavailable", err)
	}
	// persistence off: p's lease is gone, its stream is not
	srv.Restart()
	if _, err := r.Acquire(ctx, "q", 1, ttl); err != nil { // and answering again
		t.Fatalf("an Acquire once Redis is back: %v", err)
	}
	for deadline := time.Now().Add(redisWait); srv.MustCLI("ZCARD", "sse:lease:{p}") != "1"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the lease Redis lost is not back %v after Redis answered again (the next renewal is %v away)", redisWait, ttl/3)
		}
	}
}

// holdLeaseReply holds the reply of the lease script, once Redis has run it,
// until released: an Acquire under way when its leases close.
type holdLeaseReply struct {
	passThrough
	armed   atomic.Bool
	held    chan struct{} // closed once a reply is held
	release chan struct{}
}

func (h *holdLeaseReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); (name == "evalsha" || name == "eval") && err == nil && h.armed.CompareAndSwap(true, false) {
			close(h.held)
			<-h.release
		}
		return err
	}
}

// An Acquire under way when the leases close (a reload that replaces the
// hub while a stream of a capped principal opens) took its lease in Redis.
// Close used to go on without it, and the Acquire, finding the leases
// closed, dropped the lease without removing it: no stream held it, nobody
// renewed or removed it, and it counted against the principal on every
// instance until it lapsed (lease_ttl) — a principal at a cap of 1 was
// refused 429 by a lease of nothing. Close waits (within its bound) for
// Acquires under way and removes what they took.
func TestRedisLeaseTakenWhileTheLeasesCloseIsRemoved(t *testing.T) {
	for _, warm := range []bool{false, true} { // no renewal loop yet, or one running
		srv := redistest.Start(t)
		b := newTestRedis(t, srv)
		hook := &holdLeaseReply{held: make(chan struct{}), release: make(chan struct{})}
		b.client.AddHook(hook)
		r := NewRedisLeases(b)
		ctx := context.Background()
		// load the script (and, if warm, start the renewals)
		if l, err := r.Acquire(ctx, "w", 1, 5*time.Second); err != nil {
			t.Fatal(err)
		} else if !warm {
			l.Release()
			r.flushReleases()
		}
		hook.armed.Store(true)
		acquired := make(chan error, 1)
		go func() {
			_, err := r.Acquire(ctx, "p", 1, 5*time.Second)
			acquired <- err
		}()
		<-hook.held // Redis holds the lease now
		closed := make(chan struct{})
		go func() {
			r.Close()
			close(closed)
		}()
		time.Sleep(100 * time.Millisecond) // Close is under way
		close(hook.release)
		<-closed
		if err := <-acquired; err == nil {
			t.Errorf("warm %v: Acquire under way when the leases closed succeeded", warm)
		}
		if n := srv.MustCLI("ZCARD", "sse:lease:{p}"); n != "0" {
			t.Errorf("warm %v: the lease taken while the leases closed is still in Redis (%s members): no stream holds it, and it counts against the principal until it lapses", warm, n)
		}
		// an Acquire after Close takes nothing
		if _, err := r.Acquire(ctx, "q", 1, 5*time.Second); !errors.Is(err, ErrClosed) {
			t.Errorf("warm %v: Acquire after Close: %v, want ErrClosed", warm, err)
		}
		if n := srv.MustCLI("ZCARD", "sse:lease:{q}"); n != "0" {
			t.Errorf("warm %v: an Acquire after Close took a lease in Redis (%s members)", warm, n)
		}
	}
}
