package pubsub

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A primary added to scale out has no slot, and no function of the
// library, until a reshard gives it one. While a channel's slot migrates
// to it, a publish whose keys have moved there already is redirected (ASK)
// and answered "Function not found": the broker must load the library on
// that primary too, though the cluster's slot map (which lists only the
// primaries that serve slots) does not name it yet.
func TestPublishWhileTheSlotMigratesToAPrimaryJustAdded(t *testing.T) {
	publishWhileMigratingToAPrimaryJustAdded(t, RedisOptions{})
}

// The same with wait_replicas, whose publish runs on one node's connection
// and follows MOVED and ASK itself: redirected (ASK) to the primary just
// added, which the slot map does not name yet, it must publish there.
func TestWaitReplicasPublishWhileTheSlotMigratesToAPrimaryJustAdded(t *testing.T) {
	publishWhileMigratingToAPrimaryJustAdded(t, RedisOptions{WaitReplicas: 1, WaitTimeout: 20 * time.Millisecond})
}

// publishWhileMigratingToAPrimaryJustAdded publishes, with opts, at each
// phase of a slot's migration to a primary added to the cluster after the
// library was loaded on every primary there was.
func publishWhileMigratingToAPrimaryJustAdded(t *testing.T, opts RedisOptions) {
	cluster := redistest.StartCluster(t, 3)
	opts.Addrs, opts.CheckInterval = cluster.Addrs(), 300*time.Millisecond
	pub, _ := newRedisHub(t, opts)
	slot := 100
	channel := channelInSlot(t, slot)
	from := cluster.NodeOfSlot(t, slot)
	publishTo(t, pub, channel, "before") // the library is loaded on every primary there is
	spare := addEmptyPrimary(t, cluster)
	cluster.MigrateSlotByHand(t, slot, from, spare, func(phase string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := pub.Publish(ctx, channel, Message{Data: []byte(phase)}, testLimits); err != nil {
			t.Errorf("publish while the slot is %s: %v", phase, err)
		}
	})
}
