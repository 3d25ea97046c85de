package pubsub

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/replay"
)

// A stream that sees a channel before its first event holds it as "before
// the first event" in its client's id. In Redis such a channel had no key,
// so that position named no history: a client away while the channel's
// first events were published, which Redis then lost (a flush, a restart
// without persistence), was replayed the new history as if it were all,
// without sse_truncated. The channel's epoch is therefore started when this
// instance first watches it empty (FunctionOpen, a write once per channel),
// and ids hold the position before the first event of that epoch, which a
// lost history no longer has.
//
// The watch's first sync starts it, for every new channel of a check in one
// pipeline (openEmpty): new streams wait for that sync anyway (startAt).
// One call per stream instead, in a ramp of 10k streams over 1000 new
// channels, doubled the connect p99 and grew the connection pool.

// openEmpty starts the epoch of the channels in heads whose head the check
// read empty, at their watch's first sync or after the watch's epoch was
// lost (a flush while the channel was still empty): their head becomes the
// position before the first event of that epoch.
func (s *shard) openEmpty(ctx context.Context, c redis.UniversalClient, heads []headOf) {
	var empty []int
	var keys []string
	for i, h := range heads {
		if h.head == (replay.Position{}) && h.wt.channel != throttleChannel &&
			(!h.wt.isKnown() || (h.before.last.IsZero() && h.before.last.Epoch != 0)) {
			empty = append(empty, i)
			keys = append(keys, h.wt.key)
		}
	}
	if len(keys) == 0 {
		return
	}
	noArgs := func(int) []any { return nil }
	cmds := s.callPipelined(ctx, c, FunctionOpen, keys, noArgs)
	if s.w.b.libraryMended(ctx, keys[0], cmds) {
		cmds = s.callPipelined(ctx, c, FunctionOpen, keys, noArgs)
	}
	for j, cmd := range cmds {
		if head, err := openedHead(cmd.Val(), cmd.Err()); err != nil {
			s.w.b.warnUnopened(heads[empty[j]].wt.channel, err)
		} else {
			heads[empty[j]].head = head
		}
	}
}

// namedHead is head, or, for the head of a channel with no history in
// Redis (the zero position), the position before the first event of the
// epoch FunctionOpen starts for it: for a stream that read Redis itself (a
// reconnect's replay, a watch that could not start it). If that call fails
// the zero position stays, logged, and no stream calls it again for
// unopenedPause: the stream goes on, its clients' ids as they were before
// epochs were started for empty channels.
func (b *Redis) namedHead(ctx context.Context, channel, key string, head replay.Position) replay.Position {
	if head != (replay.Position{}) || channel == throttleChannel || time.Now().UnixNano() < b.unopenedUntil.Load() {
		return head
	}
	reply, err := b.call(ctx, key, FunctionOpen)
	if head, err = openedHead(reply, err); err != nil {
		b.warnUnopened(channel, err)
		return replay.Position{}
	}
	b.watch.adoptEmpty(key, head)
	return head
}

// openedHead is FunctionOpen's reply as a position (seq 0), or why not.
func openedHead(reply any, err error) (replay.Position, error) {
	if err != nil {
		return replay.Position{}, err
	}
	head, _, err := parsePublished(reply)
	if err == nil && head.Seq != 0 {
		err = fmt.Errorf("unexpected reply %v", reply)
	}
	return head, err
}

// unopenedPause is how long streams do not call FunctionOpen after a call
// failed: an ACL that refuses it would otherwise cost every reconnect a
// call, and Redis an ACL LOG entry.
const unopenedPause = time.Minute

// warnUnopened logs (rarely) that the epoch of channel could not be started.
func (b *Redis) warnUnopened(channel string, err error) {
	b.unopenedUntil.Store(time.Now().Add(unopenedPause).UnixNano())
	b.unopened.Log(b.log(), rareWarningEvery, "the epoch of a channel without events could not be started in Redis; "+
		"its streams' ids hold it as before the first event of any history", zap.String("channel", channel), zap.Error(err))
}
