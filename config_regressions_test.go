package caddysse

import (
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
