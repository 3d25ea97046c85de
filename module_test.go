package caddysse

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

func validHandler() *Handler {
	h := &Handler{Channels: []string{"a"}}
	h.applyDefaults()
	return h
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name   string
		modify func(*Handler)
		want   string
	}{
		{"nothing to do", func(h *Handler) { h.Channels = nil }, "nothing to do"},
		{"blank template", func(h *Handler) { h.Channels = []string{" "} }, "empty template"},
		// the config loaded and every stream was refused 400 channel_invalid
		{"unclosed placeholder", func(h *Handler) { h.Channels = []string{"user:{query.id"} }, "brace"},
		{"stray closing brace", func(h *Handler) { h.Channels = []string{"a}"} }, "brace"},
		{"empty placeholder", func(h *Handler) { h.Channels = []string{"a:{}"} }, "brace"},
		{"escaped brace", func(h *Handler) { h.Channels = []string{`a\{b\}`} }, "brace"},
		// text that can never be a channel: every stream was refused 400
		// channel_invalid ("empty channel name"), though the config loaded
		{"stray trailing comma", func(h *Handler) { h.Channels = []string{"news,"} }, "empty channel"},
		{"empty item between commas", func(h *Handler) { h.Channels = []string{"news, ,alerts"} }, "empty channel"},
		{"empty item beside a placeholder", func(h *Handler) { h.Channels = []string{",user:{query.id}"} }, "empty channel"},
		{"control character", func(h *Handler) { h.Channels = []string{"news\x01"} }, "control character"},
		{"too long", func(h *Handler) { h.Channels = []string{strings.Repeat("n", MaxChannelNameLen+1)} }, "longer than"},
		{"namespace with colon", func(h *Handler) { h.Namespace = "a:b" }, "namespace"},
		{"namespace with brace", func(h *Handler) { h.Namespace = "a{" }, "namespace"},
		{"history below event size", func(h *Handler) { h.HistoryBytes = h.MaxEventSize - 1 }, "history_bytes"},
		// the largest event must fit with its type and an entry's cost (Redis refuses it otherwise)
		{"history just the event size", func(h *Handler) { h.HistoryBytes = h.MaxEventSize }, "history_bytes"},
		{"more channels than a cursor holds", func(h *Handler) { h.MaxChannels = replay.MaxCursorChannels + 1 }, "max_channels"},
		{"queue bytes below event size", func(h *Handler) { h.QueueBytes = 10 }, "queue_bytes"},
		{"negative replay limit", func(h *Handler) { h.ReplayLimit = -1 }, "replay_limit"},
		{"per-principal cap without principal", func(h *Handler) { h.MaxConnectionsPerPrincipal = 2 }, "needs a principal"},
		{"negative max_connections", func(h *Handler) { h.MaxConnections = -1 }, "max_connections"},
		{"unknown rejections mode", func(h *Handler) { h.Rejections = "silent" }, "rejections"},
		{"blank principal", func(h *Handler) { h.Principal = " " }, "principal"},
		// every client resolved to the literal text: one principal, one cap
		{"unclosed principal placeholder", func(h *Handler) { h.Principal = "{query.user" }, "brace"},
		{"negative lease_ttl", func(h *Handler) { h.LeaseTTL = -1 }, "lease_ttl"},
		// its announcement is read for 24 h only: an instance starting later
		// admitted the client while Redis' key still refused it
		{"throttle beyond the redis announcements", func(h *Handler) {
			h.Redis, h.Throttle = &RedisConfig{}, caddy.Duration(25*time.Hour)
		}, "throttle"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := validHandler()
			tc.modify(h)
			if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	if err := validHandler().Validate(); err != nil {
		t.Fatalf("a valid handler: %v", err)
	}
}

// The defaults SPEC.md and the README promise, as literal values (against
// the constants, a changed constant would pass).
func TestDefaults(t *testing.T) {
	h := validHandler()
	for _, d := range []struct {
		name      string
		got, want any
	}{
		{"heartbeat", h.heartbeat(), 15 * time.Second},
		{"retry", time.Duration(h.Retry), 3 * time.Second},
		{"close_jitter", h.closeJitter(), 5 * time.Second},
		{"max_event_size", h.MaxEventSize, int64(64 << 10)},
		{"queue", h.Queue, 500},
		{"queue_bytes", h.QueueBytes, int64(1 << 20)},
		{"slow_client_timeout", time.Duration(h.SlowClientTimeout), 30 * time.Second},
		{"throttle", time.Duration(h.Throttle), 60 * time.Second},
		{"lease_ttl", time.Duration(h.LeaseTTL), 15 * time.Second},
		{"history (events)", h.HistorySize, 1000},
		{"history (age)", time.Duration(h.HistoryMaxAge), 24 * time.Hour},
		{"history_bytes", h.HistoryBytes, int64(4 << 20)},
		{"replay_limit", h.ReplayLimit, 1000},
		{"max_channels", h.MaxChannels, 32},
		{"rejections", h.Rejections, rejectionsStatus},
		{"max_connections", h.MaxConnections, 0},
		{"max_connections_per_principal", h.MaxConnectionsPerPrincipal, 0},
		{"an Idempotency-Key's life", pubsub.IdempotencyTTL, 10 * time.Minute},
	} {
		if d.got != d.want {
			t.Errorf("%s: default %v (%T), want %v (%T)", d.name, d.got, d.got, d.want, d.want)
		}
	}
	h.Heartbeat, h.CloseJitter = -1, -1
	if h.heartbeat() != 0 || h.closeJitter() != 0 {
		t.Fatal("negative heartbeat and close_jitter mean off")
	}
}

// caddy validate provisions and cleans up; it must leave nothing behind
// (no hub, no goroutine) and cope with a Cleanup after a failed Provision.
func TestValidateLeavesNothingBehind(t *testing.T) {
	cfg := adapt(t, globalOptions("")+`
:`+itoa(freePort(t))+` {
	sse /events {
		channel a
		publish {
			secret x
		}
	}
}
`)
	before := steadyGoroutines()
	if err := caddy.Validate(mustConfig(t, cfg)); err != nil {
		t.Fatal(err)
	}
	if n := settleGoroutines(before); n > before {
		t.Fatalf("goroutines %d after validate, %d before", n, before)
	}
	if refs, ok := hubs.References(embeddedHubKey); ok {
		t.Fatalf("validate left the hub in the pool with %d references", refs)
	}
}

func mustConfig(t *testing.T, raw []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

func TestCleanupAfterHalfProvision(t *testing.T) {
	h := &Handler{}
	if err := h.Cleanup(); err != nil {
		t.Fatalf("cleanup of an unprovisioned handler: %v", err)
	}
}
