package pubsub

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/rarelog"
	"github.com/caddy-sse/caddy-sse/replay"
)

// redisFunctions is the function library (see redis.lua for the data
// model). Its functions are versioned: a change of behaviour gets new names.
//
//go:embed redis.lua
var redisFunctions string

// Names of the library's functions. The module publishes with
// FunctionPublishCounted and reads with FunctionRead, the forms that
// declare the keys they use (functionKeys), so that a Redis Cluster
// migrating a channel's slot runs them where its keys are; FunctionPublish
// (the form with the base key), FunctionPublishV2 and FunctionPublishOnce
// (whose reply is the position alone) are for direct publishers.
const (
	FunctionPublish        = "sse_publish_v1"
	FunctionPublishV2      = "sse_publish_v2"
	FunctionPublishOnce    = "sse_publish_once_v2"
	FunctionPublishCounted = "sse_publish_once_v3"
	FunctionRead           = "sse_read_v4"
	// FunctionOpen starts the epoch of a channel a stream sees empty
	// (redis_open.go).
	FunctionOpen = "sse_open_v1"
)

// functionKeys are the keys a call of function declares for the channel
// of base key B: B:m and B:s (and B:p:<token> for the publish-once form,
// whose token is its first argument); only B for the _v1 forms.
func functionKeys(function, base string, args []any) []string {
	switch function {
	case FunctionRead, FunctionPublishV2, FunctionOpen:
		return []string{base + ":m", base + ":s"}
	case FunctionPublishOnce, FunctionPublishCounted:
		token, _ := args[0].(string)
		return []string{base + ":m", base + ":s", base + ":p:" + token}
	}
	return []string{base}
}

// readOnly reports whether function is called read-only (FCALL_RO,
// EVALSHA_RO, EVAL_RO): the library's read, its one function flagged
// no-writes.
func readOnly(function string) bool { return function == FunctionRead }

// RedisFunctions returns the source of the function library, for users
// who load it themselves.
func RedisFunctions() string { return redisFunctions }

// ErrUnavailable is returned when Redis cannot be reached.
var ErrUnavailable = errors.New("redis is unavailable")

// Redis is the broker for several instances: each channel's history is a
// Redis stream, each event is appended and announced on the channel's
// shard channel by one atomic function call, and each instance subscribes
// to the channels its streams read (see watcher).
type Redis struct {
	opts    RedisOptions
	client  redis.UniversalClient
	cluster *redis.ClusterClient // nil unless Redis Cluster
	deliver DeliverFunc
	logs    logStack // the newest logger its users gave it, first its own (UseLogger)
	watch   *watcher
	local   localFallback
	reads   readFlights // its streams' history reads (replays, catch-ups), shared by those that ask the same at once

	onClose       []func() // run by Close before the client closes
	onFirstStatus func()   // has the broker connect, at the first BackendStatus
	statusOnce    sync.Once
	reconnects    atomic.Uint64
	badWarned     sync.Map        // channels warned of invalid events (warnBad)
	badWarnedN    atomic.Int64    // how many badWarned holds, at most maxBadWarned
	badMany       rarelog.Warning // invalid events on channels beyond maxBadWarned
	badNotices    rarelog.Warning // malformed announcements (watcher.onNotice)
	idemFallback  rarelog.Warning // idempotency keys kept here while Redis is down
	unopened      rarelog.Warning // empty channels whose epoch could not be started (redis_open.go)
	unopenedUntil atomic.Int64    // unix ns before which streams do not try that (namedHead)
	up            atomic.Bool
	scriptsOnly   atomic.Bool // functions are forbidden: run scripts
	loads         libraryLoads
	sweepingLoads atomic.Bool   // loadFunctions' load on every primary is under way
	owedLoads     sync.Map      // primaries whose load waits for them to answer (loadWhenBack), by address
	quit          chan struct{} // closed by Close
	probes        probes        // of Redis while it is down
	denials       denials       // shards whose subscriptions Redis refuses (redis_denied.go)
	pingRefused   atomic.Bool   // Redis refused a PING (ACL), logged (warnPingRefused)
	movedLogged   atomic.Bool   // a non-cluster client was answered MOVED or ASK, logged (noteMoved)
	stateMu       sync.Mutex
	wentDown      chan struct{} // closed when Redis stops answering; replaced when it answers again
	cameBack      chan struct{} // closed when Redis answers again; replaced when it stops answering
	returns       atomic.Uint64 // how often Redis answered again after it had not
	closed        atomic.Bool
	// now is this instance's clock (time.Now); a test sets it, before any
	// use, to an instance whose clock is off Redis' and the others'
	now      func() time.Time
	clocksMu sync.Mutex
	clocks   map[*redis.Client]*primaryClock // by primary, as Now last read them
}

// primaryClock is how far a primary's clock was ahead of this instance's
// when Now read it (at, by this instance's clock).
type primaryClock struct {
	read   chan struct{} // closed once read, or failed (err)
	offset time.Duration
	at     time.Time
	err    error
}

// clockReuse is how long a primary's clock, once read, dates its channels'
// events without being read again: the streams that recover at once after
// an outage (thousands, each on channels of its own) asked it each.
const clockReuse = time.Second

// NewRedis returns a Redis broker. It does not connect: the first publish,
// read or watch does, so a server starts while Redis is down.
func NewRedis(opts RedisOptions, deliver DeliverFunc) (*Redis, error) {
	opts.applyDefaults()
	routeRedisLogs.Do(func() { redis.SetLogger(zapRedisLogger{}) })
	client, cluster, err := opts.newClient()
	if err != nil {
		return nil, err
	}
	b := &Redis{opts: opts, client: client, cluster: cluster, deliver: deliver, now: time.Now}
	b.logs.push(opts.Logger)
	goRedisLogs.push(opts.Logger)
	b.up.Store(true)
	b.wentDown = make(chan struct{})
	b.cameBack = make(chan struct{})
	close(b.cameBack) // it answers, as far as anyone knows
	b.quit = make(chan struct{})
	b.local.epoch = newLocalEpoch()
	b.watch = newWatcher(b)
	b.reads.ask, b.reads.overdue = b.askRead, readOverdue
	return b, nil
}

// Key returns the base key of a channel: "<prefix>{<channel>}".
func (b *Redis) Key(channel string) string { return b.opts.Prefix + "{" + channel + "}" }

// rareWarningEvery is how often a warning that can come per message is
// logged while its cause lasts (badNotices, idemFallback): whoever may
// publish on the prefix's shard channels can send any number of malformed
// announcements, and every keyed publish meets a Redis that is down; 500
// malformed announcements made 500 lines.
const rareWarningEvery = time.Minute

// EntryOverhead is what an event costs in a Redis history besides its type
// and data (OVERHEAD in the publish function): a history's byte cap must
// hold the largest event and this, or the function refuses it.
const EntryOverhead = 64

// Publish appends the event to the channel's stream and announces it, in
// one function call.
func (b *Redis) Publish(ctx context.Context, channel string, msg Message, lim replay.Limits) (replay.Position, error) {
	pos, _, err := b.PublishCounted(ctx, channel, msg, lim)
	return pos, err
}

// PublishCounted is Publish that also reports whether Redis answered with
// the event of an earlier call of the same token (repeat: a keyed retry, for
// a channel its first attempt published), nothing being published now.
func (b *Redis) PublishCounted(ctx context.Context, channel string, msg Message, lim replay.Limits) (pos replay.Position, repeat bool, err error) {
	if b.closed.Load() {
		return replay.Position{}, false, ErrClosed
	}
	key := b.Key(channel)
	lim = redisLimits(lim)
	// go-redis sends a command again when its reply does not come in time,
	// and a stalled Redis runs every copy it finds in its sockets once it
	// resumes: the token, the same in every copy, makes them one publish
	token, ttl := msg.Once, b.opts.publishOnceTTL()
	keyed := msg.Once != "" || (msg.TokenRequired && msg.Token != "")
	switch {
	case token == "" && msg.Token != "":
		token = msg.Token
	case token == "":
		token = publishToken()
	default:
		// a keyed request's retry may come as long as its key is kept
		ttl = max(ttl, IdempotencyTTL)
	}
	args := []any{token, ttl.Milliseconds(),
		msg.Type, msg.Data, lim.Count, lim.MaxAge.Milliseconds(), lim.MaxBytes}
	var reply any
	switch {
	case !b.reachable(ctx, key):
		// Redis is known not to answer: fail fast (see redis_probe.go)
		err = ErrUnavailable
		if ctx.Err() != nil {
			err = ctx.Err()
		}
	case b.opts.WaitReplicas > 0:
		reply, err = b.publishAndWait(ctx, key, args, keyed)
	default:
		stop := b.watchStall()
		reply, err = b.call(ctx, key, FunctionPublishCounted, args...)
		stop(err)
		reply, err = b.publishWhileMigrating(ctx, key, args, keyed, reply, err)
	}
	if err != nil {
		// a slot that is still migrating (TRYAGAIN) is Redis answering
		// "not yet", not Redis out of reach: the publish fails (503) and is
		// retried, rather than reach this instance's streams alone
		if (b.opts.FallbackLocal || fallbackLocalFrom(ctx)) && isUnavailable(err) && !isTryAgain(err) {
			return b.local.publish(channel, msg, b.deliver), false, nil
		}
		return replay.Position{}, false, err
	}
	pos, repeat, err = parsePublished(reply)
	if err == nil && msg.Once == "" {
		// a keyed publish may answer with an earlier request's event,
		// whose content is not msg's
		b.watch.deliverPublished(key, pos, msg)
	}
	return pos, repeat, err
}

// withoutToken is a publish's call without its token: FunctionPublishV2,
// whose arguments are FunctionPublishCounted's after the token and its
// ttl (the token's key cannot be made while the channel's slot migrates).
func withoutToken(args []any) (string, []any) { return FunctionPublishV2, args[2:] }

// publishToken is a new random token for one publish (its calls of
// FunctionPublishOnce): 128 bits, as 32 hex digits.
func publishToken() string {
	return fmt.Sprintf("%016x%016x", rand.Uint64(), rand.Uint64())
}

// redisLimits fills unset limits with the function's defaults: a Redis
// history is always bounded.
func redisLimits(lim replay.Limits) replay.Limits {
	if lim.Count <= 0 {
		lim.Count = 1000
	}
	if lim.MaxAge <= 0 {
		lim.MaxAge = 24 * time.Hour
	}
	if lim.MaxBytes <= 0 {
		lim.MaxBytes = 4 << 20
	}
	return lim
}

// Read reads a channel's history after a position (or only its head: for a
// channel this instance already follows, the last position it delivered).
func (b *Redis) Read(ctx context.Context, channel string, after *replay.Position, limit int) (replay.Page, error) {
	if b.closed.Load() {
		return replay.Page{}, ErrClosed
	}
	key := b.Key(channel)
	if after == nil && b.up.Load() {
		if head, ok := b.watch.startAt(ctx, key); ok {
			return replay.Page{Head: b.namedHead(ctx, channel, key, head)}, nil
		}
	} else if wt := b.watch.lookup(key); wt != nil && b.up.Load() {
		// a reconnect to a channel this instance did not follow yet learns
		// whether Redis refuses it before it replays, as a new stream does:
		// if so it opens degraded, and replays once Redis accepts it
		b.watch.awaitKnown(ctx, wt)
	}
	if b.watch.denied(key) {
		// its events cannot arrive: a stream opens degraded (redis_denied.go)
		return replay.Page{}, readDenied(b.deniedError())
	}
	ans := b.reads.read(ctx, newReadQuestion(key, after, limit))
	page, bad, err := ans.page, ans.bad, ans.err
	if bad > 0 {
		b.warnBad(channel)
	}
	if err == nil {
		page.Head = b.namedHead(ctx, channel, key, page.Head)
	}
	return page, err
}

// warnBad warns, once per channel for the broker's life (SPEC S3), that
// events published straight into Redis had an invalid type or data, or
// entries were not the library's: every read of the history, and every
// stream's replay, meets them again. It remembers maxBadWarned channels at
// most: whoever publishes straight into Redis names the channels, and the
// broker outlives reloads. Beyond them it warns rarely.
func (b *Redis) warnBad(channel string) {
	if _, warned := b.badWarned.Load(channel); warned {
		return
	}
	const msg = "events with an invalid type or non-UTF-8 data arrived through Redis, or entries its functions did not write " +
		"(a plain XADD); the events are sent as id-only blocks, the entries left out"
	if b.badWarnedN.Add(1) > maxBadWarned {
		b.badWarnedN.Add(-1)
		b.badMany.Log(b.log(), rareWarningEvery, msg, zap.String("channel", channel))
		return
	}
	if _, warned := b.badWarned.LoadOrStore(channel, true); warned {
		b.badWarnedN.Add(-1) // another read of it was first
		return
	}
	b.log().Warn(msg, zap.String("channel", channel))
}

// maxBadWarned is how many channels warnBad remembers.
const maxBadWarned = 1024

func (b *Redis) read(ctx context.Context, key string, after *replay.Position, limit int) (replay.Page, int, error) {
	reply, err := b.call(ctx, key, FunctionRead, readArgs(limit, after)...)
	if err != nil {
		return replay.Page{}, 0, err
	}
	return parsePage(reply)
}

// askRead reads what q asks (readFlights' read of Redis).
func (b *Redis) askRead(ctx context.Context, q readQuestion) readAnswer {
	page, bad, err := b.read(ctx, q.key, q.position(), q.limit)
	return readAnswer{page, bad, err}
}

// readArgs are the arguments of the library's read: at most limit events
// after a position, or only the head (after nil, limit 0).
func readArgs(limit int, after *replay.Position) []any {
	if after == nil {
		return []any{limit}
	}
	return []any{limit, after.Epoch, after.Seq, after.Time}
}

// call runs one of the library's functions on the primary of key, loading
// the library there first if Redis says it is missing.
func (b *Redis) call(ctx context.Context, key, function string, args ...any) (any, error) {
	reply, err := b.run(ctx, b.client, key, function, args...)
	if b.mended(err, func() error { return b.loadFunctions(ctx, key) }) {
		reply, err = b.run(ctx, b.client, key, function, args...)
	}
	if isFunctionMissing(err) && b.cluster != nil {
		// redirected (ASK) to a primary importing the slot, whose load
		// loadFunctions did not wait for
		b.loadOnEveryPrimary(ctx)
		reply, err = b.fcall(ctx, b.client, key, function, args...)
	}
	return reply, b.classify(err)
}

// callOn is call on one connection (for WAIT), each attempt after ASKING
// if asking: ASKING holds for the one command that follows it, and the
// attempt after loading the library was sent without it (MOVED back to
// the slot's old primary).
func (b *Redis) callOn(ctx context.Context, conn *redis.Conn, node *redis.Client, key, function string, asking bool, args ...any) (any, error) {
	attempt := func() (any, error) {
		if asking {
			if err := conn.Do(ctx, "ASKING").Err(); err != nil {
				return nil, err
			}
		}
		return b.run(ctx, conn, key, function, args...)
	}
	reply, err := attempt()
	if b.mended(err, func() error { return b.loadOn(ctx, node) }) {
		reply, err = attempt()
	}
	return reply, b.classify(err)
}

// run calls a function of the library through c, or runs its script form
// once Redis has refused functions (useScripts).
func (b *Redis) run(ctx context.Context, c scriptCaller, key, function string, args ...any) (any, error) {
	if b.scriptsOnly.Load() {
		return runScript(ctx, c, key, function, args...)
	}
	return b.fcall(ctx, c, key, function, args...)
}

// mended reports whether a call of the library that failed with err may be
// sent again: Redis forbids functions (the broker runs scripts from now
// on), or did not have the library and load has loaded it. Single calls
// (call, callOn) and pipelines (libraryMended) come here.
func (b *Redis) mended(err error, load func() error) bool {
	switch {
	case functionsForbidden(err):
		b.useScripts(err)
		return true
	case isFunctionMissing(err):
		lerr := load()
		if functionsForbidden(lerr) {
			b.useScripts(lerr)
		}
		return lerr == nil || functionsForbidden(lerr)
	}
	return false
}

// scriptCaller is what calls go through: a client or one connection.
type scriptCaller interface {
	fcaller
	redis.Scripter
}

type fcaller interface {
	FCall(ctx context.Context, function string, keys []string, args ...any) *redis.Cmd
	FCallRo(ctx context.Context, function string, keys []string, args ...any) *redis.Cmd
}

func (b *Redis) fcall(ctx context.Context, c fcaller, key, function string, args ...any) (any, error) {
	keys := functionKeys(function, key, args)
	if readOnly(function) {
		return c.FCallRo(ctx, function, keys, args...).Result()
	}
	return c.FCall(ctx, function, keys, args...).Result()
}

// loadFunctions loads the library where a call found it missing: on a
// single Redis, there; on a cluster, on the primary of key, and on every
// other primary too, since the call may have been redirected to one that
// is not yet the key's (a slot being migrated to a primary just added).
// Only the key's primary is waited for: a primary that is down (or hangs)
// must not fail, or hold up, a call that the key's primary can serve; the
// library is loaded there once it answers again (loadWhenBack).
func (b *Redis) loadFunctions(ctx context.Context, key string) error {
	node, err := b.nodeFor(ctx, key)
	if err != nil {
		return err
	}
	if b.cluster != nil && b.sweepingLoads.CompareAndSwap(false, true) {
		// one sweep at a time: a burst of calls on a fresh cluster all
		// find the library missing
		go func() {
			defer b.sweepingLoads.Store(false)
			ctx, cancel := context.WithTimeout(context.Background(), libraryLoadTimeout)
			defer cancel()
			b.loadOnEveryPrimary(ctx)
		}()
	}
	return b.loadOn(ctx, node)
}

// loadOnEveryPrimary loads the library on every primary of the cluster
// (or waits for the loads under way), and has it loaded later on those
// that do not answer now.
func (b *Redis) loadOnEveryPrimary(ctx context.Context) {
	var mu sync.Mutex
	var asked *redis.Client
	mapped := map[string]bool{}
	_ = b.cluster.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		err := b.loadOn(ctx, node)
		if err != nil && !functionsForbidden(err) && !b.closed.Load() {
			b.loadWhenBack(node.Options().Addr, err)
		}
		mu.Lock()
		mapped[node.Options().Addr] = true
		if err == nil && asked == nil {
			asked = node
		}
		mu.Unlock()
		return nil
	})
	if asked != nil {
		b.loadOnSlotlessPrimaries(ctx, asked, mapped)
	}
}

// loadWhenBack loads the library on the primary at addr, which could not
// load it now (err), as soon as it answers: a backend that publishes
// straight into Redis (FCALL) needs it there, and caddy-sse may make no
// call of its own there for a long while. One retry loop per primary; it
// ends once the library is loaded, the primary is no longer one (its slots
// failed over), the broker closes, or functions are forbidden.
func (b *Redis) loadWhenBack(addr string, err error) {
	if _, running := b.owedLoads.LoadOrStore(addr, true); running {
		return
	}
	b.log().Warn("could not load the sse Redis functions on a primary; loading them there once it answers",
		zap.String("node", addr), zap.Error(err))
	go func() {
		defer b.owedLoads.Delete(addr)
		wait := 100 * time.Millisecond
		for {
			select {
			case <-time.After(wait):
			case <-b.quit:
				return
			}
			wait = min(2*wait, 2*time.Second)
			ctx, cancel := context.WithTimeout(context.Background(), libraryLoadTimeout)
			node, err := b.primaryAtNow(ctx, addr)
			if err == nil && node != nil {
				err = b.loadOn(ctx, node)
			}
			cancel()
			if err == nil || functionsForbidden(err) || b.closed.Load() {
				return // loaded, or no longer a primary
			}
		}
	}()
}

// primaryAt returns the cluster primary at addr, nil if there is none.
func (b *Redis) primaryAt(ctx context.Context, addr string) *redis.Client {
	found, _ := b.primaryAtNow(ctx, addr)
	return found
}

// primaryAtNow is primaryAt, with the error if the cluster's state could
// not be had.
func (b *Redis) primaryAtNow(ctx context.Context, addr string) (*redis.Client, error) {
	var found *redis.Client
	var mu sync.Mutex
	err := b.cluster.ForEachMaster(ctx, func(_ context.Context, node *redis.Client) error {
		if node.Options().Addr == addr {
			mu.Lock()
			found = node
			mu.Unlock()
		}
		return nil
	})
	return found, err
}

// loadOn loads the library on node, or waits for the load of it that is
// already under way.
func (b *Redis) loadOn(ctx context.Context, node *redis.Client) error {
	addr := node.Options().Addr
	return b.loads.do(ctx, addr, func(ctx context.Context) error {
		if _, err := node.FunctionLoadReplace(ctx, redisFunctions).Result(); err != nil {
			return err
		}
		b.log().Info("loaded the sse Redis functions", zap.String("node", addr))
		return nil
	})
}

// nodeFor returns the client of the primary that serves key.
func (b *Redis) nodeFor(ctx context.Context, key string) (*redis.Client, error) {
	if b.cluster != nil {
		return b.cluster.MasterForKey(ctx, key)
	}
	return b.client.(*redis.Client), nil
}

func isFunctionMissing(err error) bool {
	return err != nil && strings.Contains(err.Error(), "Function not found")
}

// classify tells Redis' answers (a refused call: the error stands) from
// failures to reach it (ErrUnavailable), and tracks whether Redis is up.
func (b *Redis) classify(err error) error {
	if err == nil || errors.Is(err, redis.Nil) {
		b.setUp(true, nil)
		return err
	}
	if isUnavailable(err) {
		return b.unavailable(err)
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		b.setUp(true, nil)
		b.noteMoved(rerr)
		if strings.HasPrefix(rerr.Error(), "LOADING") || strings.HasPrefix(rerr.Error(), "CLUSTERDOWN") ||
			strings.HasPrefix(rerr.Error(), "READONLY") || strings.HasPrefix(rerr.Error(), "MASTERDOWN") ||
			strings.HasPrefix(rerr.Error(), "TRYAGAIN") {
			return fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		return err
	}
	return b.unavailable(err)
}

// noteMoved logs, once for the broker's life, a MOVED or ASK answer to a
// client that does not follow them: the one address configured is a node of
// a Redis Cluster, and every channel of the other nodes' slots fails (a
// publish 503, a stream 503 history_unavailable) until the config lists
// the nodes or says `cluster`.
func (b *Redis) noteMoved(rerr redis.Error) {
	msg := rerr.Error()
	if b.cluster != nil || !(strings.HasPrefix(msg, "MOVED ") || strings.HasPrefix(msg, "ASK ")) {
		return
	}
	if !b.movedLogged.Swap(true) {
		b.log().Error("redis is a cluster: list its nodes in addresses, or add cluster to use one address as a seed",
			zap.Error(rerr))
	}
}

func (b *Redis) unavailable(err error) error {
	if errors.Is(err, ErrUnavailable) {
		return err
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	if b.cluster != nil {
		// a primary may have failed over: go-redis learns it only from a
		// MOVED, which a dead primary never sends, or from a reload (in the
		// background; rate-limited by go-redis)
		b.cluster.ReloadState(context.Background())
	}
	b.setUp(false, err)
	return fmt.Errorf("%w: %v", ErrUnavailable, err)
}

// isUnavailable reports whether err is a failure to reach Redis rather than
// an answer from it. A cancelled context is neither: the caller gave up (a
// publisher that disconnected), and what it sent may be in Redis already.
// A refused authentication is a failure to reach it: nothing can be asked
// on a connection that Redis did not let in.
func isUnavailable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrUnavailable) {
		return true
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return !errors.Is(err, redis.Nil)
	}
	return isAuthRefused(rerr)
}

// isAuthRefused reports whether Redis refused the connection's
// authentication (a wrong or missing password, a disabled user). The
// connection's setup fails with that reply, so it is a redis.Error like an
// answer to a command: taken as one, each refused call marked Redis up and
// the subscriber's refused connection marked it down again, which logged
// "redis is unreachable" and "redis is reachable again" for every request.
func isAuthRefused(rerr redis.Error) bool {
	msg := rerr.Error()
	return strings.HasPrefix(msg, "WRONGPASS") || strings.HasPrefix(msg, "NOAUTH")
}

// setUp records whether Redis answers, logging each transition once.
func (b *Redis) setUp(up bool, err error) {
	if b.up.Load() == up {
		return
	}
	b.stateMu.Lock()
	defer b.stateMu.Unlock()
	if b.up.Swap(up) == up {
		return
	}
	if up {
		b.wentDown = make(chan struct{})
		close(b.cameBack)
		b.returns.Add(1)
		b.log().Info("redis is reachable again")
		b.watch.recovered()
	} else {
		close(b.wentDown)
		b.cameBack = make(chan struct{})
		b.log().Error("redis is unreachable", zap.Error(err))
	}
}

// backSignal returns a channel closed when Redis answers again (at once if
// it answers now).
func (b *Redis) backSignal() <-chan struct{} {
	b.stateMu.Lock()
	defer b.stateMu.Unlock()
	return b.cameBack
}

// downSignal returns a channel closed when Redis stops answering (at once
// if it does not answer now).
func (b *Redis) downSignal() <-chan struct{} {
	b.stateMu.Lock()
	defer b.stateMu.Unlock()
	return b.wentDown
}

// Available reports whether Redis answered the last command sent to it.
func (b *Redis) Available() bool { return b.up.Load() }

// BackendStatus reports the connection to Redis, for the metrics.
func (b *Redis) BackendStatus() BackendStatus {
	// a broker nobody has used is only presumed up (NewRedis): asked, it
	// connects, so that the answers after this one tell
	b.statusOnce.Do(func() {
		if b.onFirstStatus != nil && !b.closed.Load() {
			go b.onFirstStatus()
		}
	})
	st := BackendStatus{Up: b.up.Load(), Reconnects: b.reconnects.Load(), Channels: b.watch.count(),
		HistoryReads: b.reads.asked.Load(), HistoryReadsSent: b.reads.sent.Load()}
	if st.Denied = b.watch.countDenied(); st.Denied > 0 {
		if err := b.deniedError(); err != nil {
			st.DeniedError = err.Error()
		}
	}
	return st
}

// Now reads the clock of the Redis primary of channel, which dates its
// events: the instances' clocks may be off it, and each other's. A clock
// read less than clockReuse ago is not read again: this instance's clock
// tells how much time passed since.
func (b *Redis) Now(ctx context.Context, channel string) (time.Time, error) {
	node, err := b.nodeFor(ctx, b.Key(channel))
	if err != nil {
		return time.Time{}, b.unavailable(err)
	}
	b.clocksMu.Lock()
	c := b.clocks[node]
	reading := c == nil
	if !reading {
		select {
		case <-c.read: // read again once old, or failed
			reading = c.err != nil || b.now().Sub(c.at) > clockReuse
		default: // being read: wait for it
		}
	}
	if reading {
		c = &primaryClock{read: make(chan struct{})}
		if b.clocks == nil {
			b.clocks = make(map[*redis.Client]*primaryClock)
		}
		b.forgetOldClocks()
		b.clocks[node] = c
	}
	b.clocksMu.Unlock()
	if reading {
		sent := b.now()
		at, err := node.Time(ctx).Result()
		back := b.now()
		c.at, c.offset, c.err = back, at.Sub(sent.Add(back.Sub(sent)/2)), b.classify(err)
		close(c.read)
	}
	select {
	case <-c.read:
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	}
	if c.err != nil {
		return time.Time{}, c.err
	}
	return b.now().Add(c.offset), nil
}

// forgetOldClocks drops the reads of the primaries' clocks that Now would
// not use again (failed, or older than clockReuse): on a cluster, a
// primary that went away (a failover to another address) would otherwise
// keep its closed client in the map for the broker's life. Under clocksMu;
// the map holds one entry per primary, read at most once a clockReuse.
func (b *Redis) forgetOldClocks() {
	now := b.now()
	for node, c := range b.clocks {
		select {
		case <-c.read:
			if c.err != nil || now.Sub(c.at) > clockReuse {
				delete(b.clocks, node)
			}
		default: // being read
		}
	}
}

// Watch subscribes this instance to the channel's announcements.
func (b *Redis) Watch(channel string) { b.watch.want(channel, true) }

// Unwatch unsubscribes this instance from the channel.
func (b *Redis) Unwatch(channel string) { b.watch.want(channel, false) }

// Close stops the watcher and closes the client.
func (b *Redis) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	close(b.quit)
	watched := make(chan struct{})
	go func() {
		b.watch.close()
		close(watched)
	}()
	wait := time.NewTimer(watchCloseWait)
	defer wait.Stop()
	select {
	case <-watched:
	case <-wait.C:
		// a shard waits for a Redis that hangs: go-redis ends a read at its
		// timeout, not when its context ends, so closing the client below
		// is what ends it
	}
	for _, f := range b.onClose {
		f()
	}
	defer goRedisLogs.pop(b.opts.Logger)
	err := b.client.Close()
	wait.Reset(watchCloseWait)
	select {
	case <-watched:
	case <-wait.C:
		b.log().Warn("a Redis connection did not end when its client closed; it ends with its read timeout")
	}
	return err
}

// watchCloseWait bounds each wait of Close for the shards' goroutines.
const watchCloseWait = 500 * time.Millisecond

// Client returns the go-redis client, for other users of the same Redis
// (leases, throttles, idempotency keys).
func (b *Redis) Client() redis.UniversalClient { return b.client }

// Prefix returns the key prefix.
func (b *Redis) Prefix() string { return b.opts.Prefix }

// fallbackLocalKey marks a publish's context with WithFallbackLocal.
type fallbackLocalKey struct{}

// WithFallbackLocal returns a context that makes a publish with it fall back
// to this instance (as RedisOptions.FallbackLocal does for every publish)
// when Redis cannot be reached. The handlers of one Redis share its hub: the
// choice is each handler's, per publish, and the event reaches this
// instance's subscribers of every handler.
func WithFallbackLocal(ctx context.Context) context.Context {
	return context.WithValue(ctx, fallbackLocalKey{}, true)
}

func fallbackLocalFrom(ctx context.Context) bool {
	on, _ := ctx.Value(fallbackLocalKey{}).(bool)
	return on
}

// localFallback delivers events to this instance alone while Redis is
// unreachable (fallback local): under an epoch of its own, so any cursor
// that includes such an event is answered as truncated later.
//
// Their seqs come from one counter for every channel: each channel's
// still rise (no history follows them, so nothing needs them one apart),
// and nothing is kept per channel. A count per channel, never forgotten,
// let a publisher grow the instance by some 200 bytes for every channel
// name it published to while Redis was away.
type localFallback struct {
	mu    sync.Mutex // held across deliver: a channel's events in seq order
	epoch uint32
	seq   uint64
}

func (l *localFallback) publish(channel string, msg Message, deliver DeliverFunc) replay.Position {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	pos := replay.Position{Epoch: l.epoch, Seq: l.seq, Time: time.Now().UnixMilli()}
	ev, _ := encodeEvent(pos, msg.Type, string(msg.Data))
	ev.Local = true
	deliver(channel, ev)
	return pos
}

func newLocalEpoch() uint32 {
	for {
		if e := rand.Uint32(); e != 0 {
			return e
		}
	}
}

// Interface guards
var (
	_ Broker          = (*Redis)(nil)
	_ Clock           = (*Redis)(nil)
	_ BackendReporter = (*Redis)(nil)
)
