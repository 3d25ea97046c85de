package caddysse

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// adaptErr adapts a Caddyfile named Caddyfile.test and returns its error.
func adaptErr(input string) error {
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
	return err
}

// A history max age under a millisecond was accepted, and with Redis
// every publish then failed: the age goes to Redis in whole milliseconds,
// 0, which its function refuses ("max_age_ms a positive integer"). It is
// refused when the config loads, in the Caddyfile with its line and in
// JSON; so is a wait_replicas timeout under a millisecond (Redis' WAIT
// takes whole milliseconds: 0 waits for ever).
func TestDurationsUnderAMillisecondRedisCountsInAreRefused(t *testing.T) {
	rds := redistest.Start(t)
	port := freePort(t)
	text := globalOptions("") + strings.ReplaceAll(redisSite(rds.URL(), "history 10 500us"), "{PORT}", strconv.Itoa(port))
	if cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(text), map[string]any{"filename": "Caddyfile"}); err == nil {
		if err := caddy.Load(cfg, true); err == nil {
			t.Cleanup(func() { _ = caddy.Stop() })
			srv := &testServer{t: t, port: port, base: "http://127.0.0.1:" + strconv.Itoa(port)}
			status, reply := srv.post("/events", "application/json", []byte(`{"channel":"a","data":"x"}`), nil)
			t.Fatalf("history 10 500us with redis loaded; a publish then answers %d %s", status, reply)
		}
	}

	for _, tc := range []struct{ line, want string }{
		{"history 10 500us", "history: max age"},
		{"redis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\twait_replicas 1 500us\n\t\t}", "wait_replicas: timeout"},
	} {
		input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + tc.line + "\n\t}\n}\n"
		if err := adaptErr(input); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile.test:") {
			t.Errorf("%q: error %v, want %q naming the file and line", tc.line, err, tc.want)
		}
	}
	h := validHandler()
	h.HistoryMaxAge = caddy.Duration(500 * time.Microsecond)
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "history") {
		t.Errorf("JSON history_max_age 500us: %v, want refused", err)
	}
	if err := redisSettingsErr(&RedisConfig{URL: "redis://127.0.0.1:1", WaitReplicas: 1,
		WaitTimeout: caddy.Duration(500 * time.Microsecond)}); err == nil || !strings.Contains(err.Error(), "wait_timeout") {
		t.Errorf("JSON wait_timeout 500us: %v, want refused", err)
	}
	for _, ok := range []string{"history 10 1ms", "redis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\twait_replicas 1 1ms\n\t\t}"} {
		if err := adaptErr(":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + ok + "\n\t}\n}\n"); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
}

// Settings that conflict with each other (or with a default) were refused
// only when the config loaded, by Validate, whose error names neither the
// file nor the line: with several sse blocks, nor which one. `caddy adapt`
// passed them. They are refused naming the sse directive's line.
func TestConflictingSettingsNameFileAndLine(t *testing.T) {
	for _, lines := range []string{
		"max_event_size 8MiB", // over the default history_bytes
		"queue_bytes 1KiB",    // under the default max_event_size
		"max_connections_per_principal 2",
		"fallback local",
		"throttle 25h\n\t\tredis redis://127.0.0.1:1",
	} {
		t.Run(strings.Fields(lines)[0], func(t *testing.T) {
			input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + lines + "\n\t}\n}\n"
			if err := adaptErr(input); err == nil || !strings.Contains(err.Error(), "Caddyfile.test:2") {
				t.Fatalf("%q: error %v, want one naming Caddyfile.test:2", lines, err)
			}
		})
	}
}

// A min_retry_backoff longer than max_retry_backoff was accepted and did
// nothing: go-redis then waits max_retry_backoff before every retry.
func TestRetryBackoffsInTheWrongOrderRefused(t *testing.T) {
	if err := redisSettingsErr(&RedisConfig{URL: "redis://127.0.0.1:1", MinRetryBackoff: caddy.Duration(2 * time.Second)}); err == nil ||
		!strings.Contains(err.Error(), "min_retry_backoff") {
		t.Errorf("JSON min_retry_backoff 2s over the default max 1s: %v, want refused", err)
	}
	input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\tredis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\tmin_retry_backoff 3s\n\t\t\tmax_retry_backoff 2s\n\t\t}\n\t}\n}\n"
	if err := adaptErr(input); err == nil || !strings.Contains(err.Error(), "min_retry_backoff") || !strings.Contains(err.Error(), "Caddyfile.test:") {
		t.Errorf("Caddyfile: %v, want refused naming the file and line", err)
	}
	if err := redisSettingsErr(&RedisConfig{URL: "redis://127.0.0.1:1", MinRetryBackoff: caddy.Duration(time.Second)}); err != nil {
		t.Errorf("min_retry_backoff equal to the default max: %v", err)
	}
}

// A max_retry_backoff under go-redis' default min (10ms), given alone, was
// accepted before the backoffs were ordered, and is what the user asked
// for: go-redis then waits that max before each retry. Refusing it named a
// min_retry_backoff the config never set, and a Caddy that loaded it before
// refused to start.
func TestRetryBackoffMaxUnderTheDefaultMinAlone(t *testing.T) {
	if err := redisSettingsErr(&RedisConfig{URL: "redis://127.0.0.1:1", MaxRetryBackoff: caddy.Duration(5 * time.Millisecond)}); err != nil {
		t.Errorf("JSON max_retry_backoff 5ms alone: %v", err)
	}
	input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\tredis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\tmax_retry_backoff 5ms\n\t\t}\n\t}\n}\n"
	if err := adaptErr(input); err != nil {
		t.Errorf("Caddyfile max_retry_backoff 5ms alone: %v", err)
	}
}
