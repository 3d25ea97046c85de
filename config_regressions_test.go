package caddysse

import (
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// Settings given separately win over the URL's: an explicit db 0 next to
// a URL that names another database is the database used.
func TestExplicitDBZeroWinsOverURL(t *testing.T) {
	var h Handler
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("sse {\n\tchannel a\n\tredis {\n\t\turl redis://127.0.0.1:7000/3\n\t\tdb 0\n\t}\n}"))
	if err != nil {
		t.Fatalf("refused: %v", err)
	}
	opts, err := h.Redis.redisOptions()
	if err != nil {
		t.Fatal(err)
	}
	if opts.DB != 0 {
		t.Fatalf("`db 0` given in the block, but the client uses db %d from the URL", opts.DB)
	}
}

// The "placeholder not known at load" error does not quote the placeholder:
// it is part of the secret, e.g. "Xk{9fQ-2zT}p" from a password generator.
func TestSecretErrorDoesNotEchoTheSecret(t *testing.T) {
	h := validHandler()
	h.Publish = &PublishConfig{Secret: "Xk{9fQ-2zT}p"}
	err := h.provisionSecret()
	if err == nil {
		t.Fatal("accepted")
	}
	if strings.Contains(err.Error(), "9fQ-2zT") {
		t.Fatalf("the error shows part of the secret: %v", err)
	}
}

// With two bad durations, the one the error names is the same on every
// load (they were once checked in a map's order).
func TestNegativeDurationErrorIsDeterministic(t *testing.T) {
	rc := &RedisConfig{Addresses: []string{"127.0.0.1:7000"},
		DialTimeout: caddy.Duration(-time.Second), ReadTimeout: caddy.Duration(-time.Second),
		WriteTimeout: caddy.Duration(-time.Second), CheckInterval: caddy.Duration(-time.Second)}
	seen := map[string]bool{}
	for range 50 {
		_, err := rc.redisOptions()
		if err == nil {
			t.Fatal("accepted")
		}
		seen[err.Error()] = true
	}
	if len(seen) > 1 {
		t.Fatalf("one config, %d different errors: %v", len(seen), seen)
	}
}

// Writing out go-redis' documented defaults (README: read_timeout [5s],
// dial_timeout [5s], max_retries [3]) gives the same hub as leaving them
// out, not a second one with its own pub/sub connections.
func TestExplicitGoRedisDefaultsShareHub(t *testing.T) {
	key := func(rc *RedisConfig) string {
		h := validHandler()
		h.logger = zap.NewNop()
		h.Redis = rc
		_, k, err := h.redisOptions()
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	plain := key(&RedisConfig{URL: "redis://127.0.0.1:7000"})
	written := key(&RedisConfig{URL: "redis://127.0.0.1:7000", ReadTimeout: caddy.Duration(5 * time.Second),
		DialTimeout: caddy.Duration(5 * time.Second), MaxRetries: 3})
	if plain != written {
		t.Fatalf("the documented defaults, written or not, give two hubs:\n%s\n%s", plain, written)
	}
}

// README: "a malformed URL is a configuration error, as is a URL or
// credential whose placeholder resolves to nothing (an unset
// {env.REDIS_PASSWORD})". A placeholder inside the URL (its password, its
// host) or an address that resolves to nothing is refused too: it once
// left a URL without its password (every call then NOAUTH, at the first
// request) or without its host, which go-redis dials as localhost.
func TestRedisPlaceholderResolvingToNothingInsideURLRefused(t *testing.T) {
	const unset = "CADDY_SSE_TEST_SURELY_UNSET_REDIS_PART"
	if _, set := os.LookupEnv(unset); set {
		t.Fatalf("%s must not be set", unset)
	}
	for _, rc := range []*RedisConfig{
		{URL: "redis://:{env." + unset + "}@127.0.0.1:7000"},
		{URL: "redis://{env." + unset + "}:7000/0"},
		{Addresses: []string{"{env." + unset + "}:7000"}},
		{Addresses: []string{"127.0.0.1:7000"}, TLS: &RedisTLS{ServerName: "{env." + unset + "}"}},
		{Addresses: []string{"127.0.0.1:7000"}, Prefix: "{env." + unset + "}"},
		{Addresses: []string{"127.0.0.1:26379"}, Sentinel: "{env." + unset + "}"},
	} {
		opts, err := rc.redisOptions()
		if err == nil {
			t.Errorf("url %q, addresses %q accepted: dials %v with password %q", rc.URL, rc.Addresses, opts.Addrs, opts.Password)
			continue
		}
		if !strings.Contains(err.Error(), "environment variable") {
			t.Errorf("url %q, addresses %q: error %v, want one asking whether the variable is set", rc.URL, rc.Addresses, err)
		}
	}
	// set, it is used; a brace that is no known placeholder (a password
	// from a generator) is kept as it is
	t.Setenv(unset, "secret")
	opts, err := (&RedisConfig{URL: "redis://:{env." + unset + "}@127.0.0.1:7000"}).redisOptions()
	if err != nil || opts.Password != "secret" {
		t.Fatalf("set: password %q, error %v", opts.Password, err)
	}
	opts, err = (&RedisConfig{Addresses: []string{"127.0.0.1:7000"}, Password: "Xk{9fQ}p"}).redisOptions()
	if err != nil || opts.Password != "Xk{9fQ}p" {
		t.Fatalf("literal braces: password %q, error %v", opts.Password, err)
	}
}

// The key prefix and the Sentinel master's name resolve their placeholders
// as the other settings do. Unresolved, a prefix of {env.APP}: was taken as
// written: instances meant to be apart shared their channels, and the
// braces, a Redis Cluster hash tag, put every key in one slot. Braces left
// in a prefix are refused for that reason.
func TestRedisPrefixAndSentinelResolvePlaceholders(t *testing.T) {
	const app = "CADDY_SSE_TEST_PREFIX_APP"
	t.Setenv(app, "billing")
	opts, err := (&RedisConfig{Addresses: []string{"127.0.0.1:26379"}, Prefix: "{env." + app + "}:",
		Sentinel: "{env." + app + "}-primary"}).redisOptions()
	if err != nil || opts.Prefix != "billing:" || opts.MasterName != "billing-primary" {
		t.Fatalf("prefix %q, sentinel %q, error %v", opts.Prefix, opts.MasterName, err)
	}
	for _, prefix := range []string{"app{1}:", "{unknown.placeholder}:", "sse}"} {
		_, err := (&RedisConfig{Addresses: []string{"127.0.0.1:7000"}, Prefix: prefix}).redisOptions()
		if err == nil || !strings.Contains(err.Error(), "slot") {
			t.Errorf("prefix %q: error %v, want a refusal of its braces", prefix, err)
		}
	}
}

// The JSON config refuses sizes the Caddyfile refuses (over 1 TiB): an
// "unlimited" max_event_size of 2^63-1 (with queue_bytes to match) wrapped
// max_event_size + 264 around, so the history_bytes check passed with the
// default 4 MiB, and the publish body limit (6 × max_event_size + ...)
// wrapped to about 100 KiB: the config loaded with bounds it did not have.
func TestHugeSizesRefusedAsInTheCaddyfile(t *testing.T) {
	h := validHandler()
	h.MaxEventSize, h.QueueBytes = math.MaxInt64, math.MaxInt64
	if err := h.Validate(); err == nil {
		t.Fatalf("accepted: history_bytes %d below max_event_size %d, publish body limit %d", h.HistoryBytes, h.MaxEventSize, h.bodyLimit())
	}
	h = validHandler()
	h.MaxEventSize, h.QueueBytes, h.HistoryBytes = 1<<40, 1<<40, 1<<40+264
	if err := h.Validate(); err == nil {
		t.Fatal("a history_bytes over 1 TiB accepted; the Caddyfile refuses it")
	}
}
