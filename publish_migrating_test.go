package caddysse

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// Cluster, a publish without an Idempotency-Key to two channels: the slot
// of one is migrating (a reshard), the primary of the other hangs past
// read_timeout. The reply is 503 offering a key to retry under; the retry,
// once the reshard is over and the primary answers, publishes the event
// once to each channel. The migrating channel's publish went without its
// token (the token's key cannot be made while the slot migrates) and was
// published, and the retry, finding no token, published it a second time.
func TestAPublishToAMigratingSlotIsRetriedOnceUnderItsOfferedKey(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, redisBlockSite("addresses "+strings.Join(cluster.Addrs(), " ")+
		"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms"))
	moving, hung := channelsOnTwoPrimaries(t, cluster)
	from, hungNode := cluster.NodeOfSlot(t, redistest.SlotOf(moving)), cluster.NodeOfSlot(t, redistest.SlotOf(hung))
	to := thirdPrimary(cluster, from, hungNode)
	for _, ch := range []string{moving, hung} {
		srv.publish("/events", map[string]any{"channel": ch, "data": "before"})
	}
	body := mustJSON(t, map[string]any{"channel": []string{moving, hung}, "data": "once"})
	var failure errorBody
	cluster.MigrateSlotByHand(t, redistest.SlotOf(moving), from, to, func(phase string) {
		if phase != "migrating" {
			return
		}
		hungNode.Pause()
		status, reply := srv.post("/events", "application/json", body, nil)
		hungNode.Resume()
		if err := json.Unmarshal(reply, &failure); err != nil || status != http.StatusServiceUnavailable || failure.IdempotencyKey == "" {
			t.Fatalf("publish while a slot migrates and a primary hangs: %d %s, want 503 offering a key", status, reply)
		}
	})
	retryUnderKey(t, srv, body, failure.IdempotencyKey)
	for ch, node := range map[string]*redistest.Server{moving: to, hung: hungNode} {
		eventually(t, "the hung primary runs the call it held", func() bool {
			return node.MustCLI("XLEN", "sse:{"+ch+"}:s") != "1"
		})
		if n := node.MustCLI("XLEN", "sse:{"+ch+"}:s"); n != "2" {
			t.Errorf("channel %s holds %s events, want 2 (before, and the event once)", ch, n)
		}
	}
}

// channelsOnTwoPrimaries returns two channels whose slots two different
// primaries serve.
func channelsOnTwoPrimaries(t *testing.T, cluster *redistest.Cluster) (string, string) {
	t.Helper()
	first := cluster.NodeOfSlot(t, redistest.SlotOf("a"))
	for i := 0; ; i++ {
		ch := fmt.Sprintf("b%d", i)
		if cluster.NodeOfSlot(t, redistest.SlotOf(ch)) != first {
			return "a", ch
		}
	}
}

// thirdPrimary returns the primary of cluster that is neither a nor b.
func thirdPrimary(cluster *redistest.Cluster, a, b *redistest.Server) *redistest.Server {
	for _, n := range cluster.Nodes {
		if n != a && n != b {
			return n
		}
	}
	return nil
}
