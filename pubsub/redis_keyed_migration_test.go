package pubsub

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A keyed publish (an Idempotency-Key's token, Once; or a token a request
// to several channels requires, whose retry under the key its failure
// offers must not publish again where it went) keeps its token while its
// slot migrates. Published without it, as other publishes are, the retry
// of the request under its key found no record of the first attempt and
// published the event again. It fails while the keys move (503: its
// request is retried under its key) and publishes once after. A token no
// request requires still goes without: publishing is not held up for it.
func TestKeyedPublishWhileTheSlotMigratesPublishesOnce(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	waitReplicas := func(o RedisOptions) RedisOptions {
		o.WaitReplicas, o.WaitTimeout = 1, 50*time.Millisecond
		return o
	}
	same := func(o RedisOptions) RedisOptions { return o }
	fallbackLocal := func(o RedisOptions) RedisOptions {
		o.FallbackLocal = true
		return o
	}
	for i, tc := range []struct {
		name   string
		opts   func(RedisOptions) RedisOptions
		msg    Message
		strict bool // the publish waits for the keys to move
	}{
		{"once", same, Message{Data: []byte("paid"), Once: "key-1"}, true},
		{"required token", same, Message{Data: []byte("paid"), Token: "key-1", TokenRequired: true}, true},
		{"once, wait replicas", waitReplicas, Message{Data: []byte("paid"), Once: "key-1"}, true},
		// Redis answers: the publish is not delivered to this instance alone
		{"once, fallback local", fallbackLocal, Message{Data: []byte("paid"), Once: "key-1"}, true},
		{"token", same, Message{Data: []byte("paid"), Token: "key-1"}, false},
		{"token, wait replicas", waitReplicas, Message{Data: []byte("paid"), Token: "key-1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hub, _ := newRedisHub(t, tc.opts(RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}))
			slot := 200 + i
			channel := channelInSlot(t, slot)
			from := cluster.NodeOfSlot(t, slot)
			to := cluster.OtherPrimary(from)
			publishTo(t, hub, channel, "before")
			moved := false
			cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_, repeat, err := hub.PublishCounted(ctx, channel, tc.msg, testLimits)
				switch {
				case phase != "moved" && tc.strict:
					if !errors.Is(err, ErrUnavailable) {
						t.Errorf("a keyed publish while the slot is %s: %v, want ErrUnavailable (nothing published)", phase, err)
					}
				case phase != "moved":
					if err != nil {
						t.Errorf("a publish while the slot is %s: %v", phase, err)
					}
				default:
					moved = true
					if err != nil || repeat {
						t.Errorf("the publish once the slot moved: repeat %v, %v", repeat, err)
					}
					if _, repeat, err := hub.PublishCounted(ctx, channel, tc.msg, testLimits); err != nil || !repeat {
						t.Errorf("its retry: repeat %v, %v; want the first one's event", repeat, err)
					}
				}
			})
			if !moved {
				t.Fatal("the slot did not move")
			}
			want := "2" // before, and the keyed publish once
			if !tc.strict {
				want = "4" // before, one while migrating, one migrated, one moved
			}
			if n := to.MustCLI("XLEN", "sse:{"+channel+"}:s"); n != want {
				t.Fatalf("the channel holds %s events, want %s", n, want)
			}
		})
	}
}
