package caddysse

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// Cluster, a publish without an Idempotency-Key to two channels: the slot
// of one is migrating (a reshard), the other fails (a key of the wrong type
// stands where its history goes). The reply is 503 offering a key to
// retry under; the retry, once the reshard is over and the other channel
// is mended, publishes the event once to each channel. The migrating
// channel's publish went without its token (the token's key cannot be
// made while the slot migrates) and was published, and the retry, finding
// no token, published it a second time.
func TestAPublishToAMigratingSlotIsRetriedOnceUnderItsOfferedKey(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, redisBlockSite("addresses "+strings.Join(cluster.Addrs(), " ")+
		"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tcheck_interval 300ms"))
	moving, broken := "a", "b"
	from, brokenNode := cluster.NodeOfSlot(t, redistest.SlotOf(moving)), cluster.NodeOfSlot(t, redistest.SlotOf(broken))
	to := cluster.OtherPrimary(from)
	srv.publish("/events", map[string]any{"channel": moving, "data": "before"})
	brokenNode.MustCLI("SET", "sse:{"+broken+"}:m", "not a hash")

	body := mustJSON(t, map[string]any{"channel": []string{moving, broken}, "data": "once"})
	var failure errorBody
	cluster.MigrateSlotByHand(t, redistest.SlotOf(moving), from, to, func(phase string) {
		if phase != "migrating" {
			return
		}
		status, reply := srv.post("/events", "application/json", body, nil)
		if err := json.Unmarshal(reply, &failure); err != nil || status != http.StatusServiceUnavailable || failure.IdempotencyKey == "" {
			t.Fatalf("publish while a slot migrates and another channel fails: %d %s, want 503 offering a key", status, reply)
		}
	})
	brokenNode.MustCLI("DEL", "sse:{"+broken+"}:m")
	ids := retryUnderKey(t, srv, body, failure.IdempotencyKey)
	if ids[moving] == "" || ids[broken] == "" {
		t.Fatalf("the retry's ids: %v", ids)
	}
	if n := to.MustCLI("XLEN", "sse:{"+moving+"}:s"); n != "2" {
		t.Errorf("channel %s holds %s events, want 2 (before, and the event once)", moving, n)
	}
}
