package pubsub

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
	"github.com/caddy-sse/caddy-sse/replay"
)

// queueSyncLocked adds a confirmed key to the next check of new heads.
func (s *shard) queueSyncLocked(key string) {
	if len(s.toSync) == 0 {
		s.toSyncSince = time.Now()
	}
	s.toSync = append(s.toSync, key)
}

// syncDueLocked reports whether the confirmed keys should be checked
// before the rest of the subscriptions sent are confirmed: while a burst of
// new channels keeps subscriptions in flight, the first ones must not wait
// for a lull (their streams wait for the sync).
func (s *shard) syncDueLocked() bool {
	return len(s.toSync) >= checkBatchSize || time.Since(s.toSyncSince) >= syncBatchWait
}

// syncBatchWait is how long confirmed keys wait for others to be checked
// with them while subscriptions are still in flight.
const syncBatchWait = 5 * time.Millisecond

// maybeCheck compares heads: of channels just (re)subscribed, once all
// subscriptions are confirmed or the connection is idle; of every channel,
// once per check interval — but for those still to have their first sync
// and whose subscription Redis has not confirmed (syncHead).
//
// The check runs on a goroutine of its own, one at a time per shard. On
// the receive loop, every event announced while it read the heads of all
// the shard's channels waited in the socket: a stall every check interval
// that grows with the channels (docs/PERFORMANCE.md: spread p99.9 20–34 ms
// → 10–12 ms on a slow box). A check that finds a channel delivered past
// the head it read leaves it alone (syncHead). Keys confirmed while a check
// runs wait for its end, which looks again.
func (s *shard) maybeCheck(idle bool) {
	s.mu.Lock()
	var keys []string
	full := time.Since(s.lastCheck) >= s.w.b.opts.CheckInterval
	if full && s.unconfirmedTooLong() {
		ps, waiting := s.ps, s.unconfirmed
		s.mu.Unlock()
		s.w.b.log().Warn("Redis did not confirm channel subscriptions; reconnecting to subscribe again",
			zap.String("shard", s.id), zap.Int("unconfirmed", waiting))
		if ps != nil {
			s.kill(ps)
		}
		return
	}
	if s.checking || s.closed {
		s.mu.Unlock()
		return
	}
	switch {
	case full:
		s.lastCheck = time.Now()
		for key, wt := range s.keys {
			if wt.subscribed.Load() || wt.isKnown() { // the others' confirmations sync them
				keys = append(keys, key)
			}
		}
		s.toSync = s.toSync[:0]
	case len(s.toSync) > 0 && (s.unconfirmed <= 0 || idle || s.syncDueLocked()):
		// a key subscribed both by connect and by a batch racing it is
		// confirmed twice: check it once
		keys = slices.Compact(slices.Sorted(slices.Values(s.toSync)))
		s.toSync = s.toSync[:0]
	}
	if len(keys) > 0 {
		s.checking = true
		s.w.wg.Add(1) // under mu, before close: the shard's run holds a count too
		go s.runCheck(keys)
	}
	s.mu.Unlock()
}

// runCheck checks keys, then whatever became due meanwhile.
func (s *shard) runCheck(keys []string) {
	defer s.w.wg.Done()
	s.check(keys)
	s.mu.Lock()
	s.checking = false
	s.mu.Unlock()
	s.maybeCheck(false)
}

// check reads the heads of keys in pipelines and syncs each watch.
func (s *shard) check(keys []string) {
	for len(keys) > 0 {
		n := min(checkBatchSize, len(keys))
		s.checkBatch(keys[:n])
		keys = keys[n:]
	}
}

// checkBatchSize is how many heads one pipeline reads. Redis serves no
// other client while it runs a pipeline's commands (as many as one read
// of its socket brings): a small batch lets publishes in between. 128
// HMGETs take Redis about 0.1–0.4 ms, 128 calls of the library's read (the
// newest events of channels synced for the first time) about 1–1.5 ms.
const checkBatchSize = 128

// checkBatch syncs the heads of keys.
func (s *shard) checkBatch(keys []string) {
	ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
	defer cancel()
	r := s.readHeads(ctx, s.currentClient(), keys)
	if len(r.asked) > 0 {
		// the slot is migrating and these channels' keys are on the
		// primary importing it (ASK): read them there, through the
		// cluster client. The subscriptions stay here, with the slot, until
		// it moves (Redis unsubscribes them then); moving them away
		// placed them here again, in a loop as fast as the round trips
		// went, and no check read their heads until the slot moved.
		there := s.readHeads(ctx, s.w.b.client, r.asked)
		r.synced = append(r.synced, there.synced...)
		r.moved = append(r.moved, there.moved...)
	}
	for _, h := range r.synced {
		s.w.syncHead(h)
	}
	if len(r.moved) > 0 {
		s.moveSlotsOf(r.moved)
	}
}

// heads is what readHeads read: the heads of the watches (with the newest
// event of those to sync for the first time), and the keys that moved to
// another primary (MOVED) and whose slot is migrating with their keys on
// the importing primary (ASK).
type heads struct {
	synced       []headOf
	moved, asked []string
}

// readHeads reads the heads of keys through c, in one pipeline
// (readHeadsPipelined), and then the newest events that readNewest reads.
func (s *shard) readHeads(ctx context.Context, c redis.UniversalClient, keys []string) (r heads) {
	// what each watch had delivered before the heads were read: the
	// receive loop goes on delivering while they are (syncHead)
	watches := make([]*watch, len(keys))
	before := make([]watchMark, len(keys))
	for i, key := range keys {
		if wt := s.w.lookup(key); wt != nil {
			watches[i], before[i] = wt, wt.mark()
		}
	}
	for i, got := range s.readHeadsPipelined(ctx, c, keys) {
		switch err := got.err; {
		case isAsk(err):
			r.asked = append(r.asked, keys[i])
			continue
		case isMoved(err):
			r.moved = append(r.moved, keys[i])
			continue
		case err != nil:
			s.w.b.classify(err)
			continue
		}
		if wt := watches[i]; wt != nil {
			r.synced = append(r.synced, headOf{wt: wt, head: got.head, before: before[i]})
		}
	}
	s.readNewest(ctx, c, r.synced)
	s.openEmpty(ctx, c, r.synced)
	return r
}

// headOf is a watch's head as a check read it, with its newest event for
// a watch that is not synced yet.
type headOf struct {
	wt     *watch
	head   replay.Position
	newest *replay.Event
	// before is where the watch was when the head was read
	before watchMark
	// unread is why Redis failed the read of newest (syncHead waits for
	// the next check); nil if it did not
	unread error
}

// readNewest reads, in one pipeline, the newest event of every channel in
// heads whose watch has its first sync to come (syncHead delivers it). One
// read each in turn cost the shard's connection a round trip per channel
// while every new stream of those channels waited for the sync.
func (s *shard) readNewest(ctx context.Context, c redis.UniversalClient, heads []headOf) {
	var first []int
	var keys []string
	for i, h := range heads {
		if !h.head.IsZero() && !h.wt.isKnown() {
			first = append(first, i)
			keys = append(keys, h.wt.key)
		}
	}
	if len(keys) == 0 {
		return
	}
	args := func(j int) []any {
		beyond := beyondHead(heads[first[j]].head)
		return readArgs(1, &beyond) // truncated: the newest
	}
	cmds := s.readPipelined(ctx, c, keys, args)
	if s.w.b.libraryMended(ctx, keys[0], cmds) {
		cmds = s.readPipelined(ctx, c, keys, args)
	}
	for j, cmd := range cmds {
		h := &heads[first[j]]
		reply, err := cmd.Result()
		if err != nil {
			s.w.b.log().Debug("reading a channel's newest event for its first sync failed; the next check syncs it", zap.String("key", keys[j]), zap.Error(err))
			h.unread = err
			continue
		}
		page, bad, err := parsePage(reply)
		if err != nil || len(page.Events) != 1 {
			continue // none to deliver: a history emptied, or an event not valid
		}
		s.w.warnBad(h.wt, bad)
		h.newest = page.Events[0]
	}
}

// libraryMended reports whether calls of the library failed because Redis
// forbids functions (the broker runs scripts from now on) or did not have
// the library (it has been loaded on key's primary): the calls may be sent
// again. A check's one call of the library per pipeline (the heads are read
// without it) and the first syncs' reads of newest events come here.
func (b *Redis) libraryMended(ctx context.Context, key string, cmds []*redis.Cmd) bool {
	for _, cmd := range cmds {
		if err := cmd.Err(); functionsForbidden(err) || isFunctionMissing(err) {
			return b.mended(err, func() error { return b.loadFunctions(ctx, key) })
		}
	}
	return false
}

// readPipelined runs the library's read on each of keys, with args(i) for
// keys[i], in one pipeline through c; each command's error is for the
// caller.
func (s *shard) readPipelined(ctx context.Context, c redis.UniversalClient, keys []string, args func(i int) []any) []*redis.Cmd {
	return s.callPipelined(ctx, c, FunctionRead, keys, args)
}

// callPipelined runs one of the library's functions on each of keys, with
// args(i) for keys[i], in one pipeline through c; each command's error is
// for the caller.
//
// Where Redis forbids functions the calls are scripts called by digest
// (EVALSHA_RO): sent with its source (EVAL_RO), each read carried the
// library's 13.6 KB, and a first sync of 1000 channels sent Redis 13.6 MB
// and had it hash each copy to find the script. A Redis that does not have
// the script (a restart, SCRIPT FLUSH) is given it by the first call, sent
// with its source (EVAL caches what it runs; SCRIPT LOAD is not in the
// least-privilege user's grants), and the others are sent again by digest.
func (s *shard) callPipelined(ctx context.Context, c redis.UniversalClient, function string, keys []string, args func(i int) []any) []*redis.Cmd {
	if !s.w.b.scriptsOnly.Load() {
		return sendCalls(ctx, c, function, keys, args, callByFunction)
	}
	cmds := sendCalls(ctx, c, function, keys, args, callByDigest)
	if !slices.ContainsFunc(cmds, isNoScript) {
		return cmds
	}
	first := sendCalls(ctx, c, function, keys[:1], args, callBySource)
	if len(keys) == 1 {
		return first
	}
	rest := func(i int) []any { return args(i + 1) }
	return append(first, sendCalls(ctx, c, function, keys[1:], rest, callByDigest)...)
}

// libraryCall is how a pipeline calls one of the library's functions.
type libraryCall int

const (
	callByFunction libraryCall = iota // FCALL, FCALL_RO for the read
	callByDigest                      // EVALSHA(_RO) of its script form
	callBySource                      // EVAL(_RO) of its script form
)

// sendCalls runs function on each of keys in one pipeline, read-only
// (FCALL_RO, EVALSHA_RO, EVAL_RO) if it is (readOnly).
func sendCalls(ctx context.Context, c redis.UniversalClient, function string, keys []string, args func(i int) []any, how libraryCall) []*redis.Cmd {
	pipe := c.Pipeline()
	cmds := make([]*redis.Cmd, len(keys))
	script, ro := scripts[function], readOnly(function)
	for i, key := range keys {
		declared := functionKeys(function, key, nil)
		switch {
		case how == callByFunction && ro:
			cmds[i] = pipe.FCallRo(ctx, function, declared, args(i)...)
		case how == callByFunction:
			cmds[i] = pipe.FCall(ctx, function, declared, args(i)...)
		case how == callByDigest && ro:
			cmds[i] = script.EvalShaRO(ctx, pipe, declared, args(i)...)
		case how == callByDigest:
			cmds[i] = script.EvalSha(ctx, pipe, declared, args(i)...)
		case ro:
			cmds[i] = script.EvalRO(ctx, pipe, declared, args(i)...)
		default:
			cmds[i] = script.Eval(ctx, pipe, declared, args(i)...)
		}
	}
	_, _ = pipe.Exec(ctx)
	return cmds
}

// isNoScript reports whether Redis did not have the script a command
// called by digest.
func isNoScript(cmd *redis.Cmd) bool {
	err := cmd.Err()
	return errors.Is(err, redis.ErrNoScript) || (err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT"))
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// isAsk reports whether err sends a command, this once, to the primary
// importing its slot: the slot is migrating, and the keys are there.
func isAsk(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "ASK ")
}

// redirectedSlot is the slot a MOVED or ASK names, -1 if it names none.
func redirectedSlot(err error) int {
	fields := strings.Fields(err.Error())
	if len(fields) < 2 {
		return -1
	}
	slot, convErr := strconv.Atoi(fields[1])
	if convErr != nil || slot < 0 || slot >= clusterslot.Count {
		return -1
	}
	return slot
}

func isMoved(err error) bool {
	return err != nil && (strings.HasPrefix(err.Error(), "MOVED ") || strings.HasPrefix(err.Error(), "ASK "))
}
