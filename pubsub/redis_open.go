package pubsub

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/replay"
)

// A stream that sees a channel before its first event holds it as "before
// the first event" in its client's id. In Redis such a channel had no key,
// so that position named no history: a client away while the channel's
// first events were published, which Redis then lost (a flush, a restart
// without persistence, a failover that lost the writes), was replayed the
// new history as if it were all, without sse_truncated. The channel's epoch
// is therefore started when a stream first sees it empty (FunctionOpen, a
// write once per channel), and its ids hold the position before the first
// event of that epoch, which a lost history no longer has.

// namedHead is head, or, for the head of a channel with no history in
// Redis (the zero position), the position before the first event of the
// epoch FunctionOpen starts for it. If that call fails the zero position
// stays (logged): the stream goes on, its clients' ids as they were before
// epochs were started for empty channels.
func (b *Redis) namedHead(ctx context.Context, channel, key string, head replay.Position) replay.Position {
	if head != (replay.Position{}) || channel == throttleChannel {
		return head
	}
	reply, err := b.call(ctx, key, FunctionOpen, false)
	if err == nil {
		head, _, err = parsePublished(reply)
	}
	if err == nil && head.Seq != 0 {
		err = fmt.Errorf("unexpected reply %v", reply)
	}
	if err != nil {
		b.unopened.Log(b.log(), rareWarningEvery, "the epoch of a channel without events could not be started in Redis; "+
			"its streams' ids hold it as before the first event of any history", zap.String("channel", channel), zap.Error(err))
		return replay.Position{}
	}
	b.watch.adoptEmpty(key, head)
	return head
}
