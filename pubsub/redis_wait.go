package pubsub

// wait_replicas: a publish and its WAIT on one connection.

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// publishAndWait publishes and then waits for replicas on the same
// connection, as WAIT counts the writes of its own connection. One node's
// connection does not follow the cluster as the cluster client does, so
// this follows a reshard or failover itself, as publishWhileMigrating
// does: to where MOVED or ASK sends it, and without the token while Redis
// answers TRYAGAIN (the token's key cannot be made while the slot
// migrates) unless keyed.
func (b *Redis) publishAndWait(ctx context.Context, key string, args []any, keyed bool) (any, error) {
	node, err := b.nodeFor(ctx, key)
	if err != nil {
		return nil, b.unavailable(err)
	}
	function, asking, attempts := FunctionPublishCounted, false, 5
	if keyed {
		attempts = keyedMigrationAttempts + 1
	}
	var pause migrationPause
	for attempt := 0; ; attempt++ {
		reply, err := b.publishAndWaitOn(ctx, node, key, function, asking, args)
		to, moved := movedTo(err)
		switch {
		case b.cluster == nil || attempt == attempts || (!moved && !isTryAgain(err)):
			return reply, err
		case moved:
			// nothing else may tell this instance (it may follow no
			// stream of the channel); ASK is for this call only
			if asking = strings.HasPrefix(err.Error(), "ASK "); !asking {
				b.cluster.ReloadState(ctx)
			}
			if node = b.primaryAt(ctx, to); node == nil || asking {
				// ASKING holds for the one command after it, and go-redis
				// sends a command again by itself (TRYAGAIN), without it:
				// MOVED back. And the primary an ASK names may serve no
				// slot yet (one just added), unknown to the slot map. A
				// client of its own, that does not retry.
				o := b.opts.nodeOptions(to)
				o.MaxRetries = -1
				tmp := redis.NewClient(o)
				defer tmp.Close()
				node = tmp
			}
		case function == FunctionPublishCounted && !keyed:
			function, args = withoutToken(args)
		default: // the keys are being moved: try again in a moment
			if !pause.wait(ctx) {
				return reply, err
			}
		}
	}
}

// publishAndWaitOn is publishAndWait on node, after ASKING if asking (the
// slot is being imported there).
func (b *Redis) publishAndWaitOn(ctx context.Context, node *redis.Client, key, function string, asking bool, args []any) (any, error) {
	conn := node.Conn()
	defer conn.Close()
	stop := b.watchStall()
	reply, err := b.callOn(ctx, conn, node, key, function, asking, args...)
	stop(err)
	if err != nil {
		return nil, err
	}
	acked, err := conn.Wait(ctx, b.opts.WaitReplicas, b.opts.WaitTimeout).Result()
	if err != nil {
		// the event is published (the function answered) and announced:
		// failing now would have it published again (a retry, fallback
		// local). Its replicas could not be counted: as too few acks
		b.log().Warn("published event's replicas could not be counted",
			zap.String("key", key), zap.Error(b.classify(err)))
		return reply, nil
	}
	if int(acked) < b.opts.WaitReplicas {
		b.log().Warn("published event not acknowledged by enough replicas",
			zap.String("key", key), zap.Int64("acknowledged", acked), zap.Int("wanted", b.opts.WaitReplicas))
	}
	return reply, nil
}
