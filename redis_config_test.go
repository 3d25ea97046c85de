package caddysse

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// redisSettingsErr runs what Provision and Validate check of a handler's
// Redis settings (Provision builds the options; Validate the rest).
func redisSettingsErr(rc *RedisConfig) error {
	if _, err := rc.redisOptions(); err != nil {
		return err
	}
	h := validHandler()
	h.Redis = rc
	return h.Validate()
}

// README: `db <n>  # [0]`. Writing the default out is accepted.
func TestRedisDBZeroAccepted(t *testing.T) {
	var h Handler
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("sse {\n\tchannel a\n\tredis {\n\t\taddresses 127.0.0.1:7000\n\t\tdb 0\n\t}\n}"))
	if err != nil {
		t.Fatalf("db 0 (the documented default) is refused: %v", err)
	}
}

// RedisConfig.URL: "Give either URL or Addresses." Both are refused (they
// once made a single server a cluster of two addresses).
func TestRedisURLAndAddressesRefused(t *testing.T) {
	var h Handler
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("sse {\n\tchannel a\n\tredis {\n\t\turl redis://127.0.0.1:7000\n\t\taddresses 127.0.0.1:7001\n\t}\n}"))
	if err == nil {
		opts, oerr := h.Redis.redisOptions()
		err = oerr
		if err == nil {
			t.Fatalf("url and addresses both accepted: addresses %v, cluster mode %v", opts.Addrs, len(opts.Addrs) > 1)
		}
	}
}

// A repeated subdirective in the redis block is refused, as in the sse
// block (the last one once won silently, e.g. of two passwords).
func TestRedisDuplicateSubdirectiveRefused(t *testing.T) {
	var h Handler
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("sse {\n\tchannel a\n\tredis {\n\t\taddresses 127.0.0.1:7000\n\t\tpassword first\n\t\tpassword second\n\t}\n}"))
	if err == nil || !strings.Contains(err.Error(), "more than once") {
		t.Fatalf("error %v, want one saying password is given more than once", err)
	}
}

// The JSON config refuses what the Caddyfile refuses: negative Redis
// durations (a negative dial_timeout made every dial fail at once; a
// negative check_interval or wait_timeout was replaced by the default) and
// max_retries below -1.
func TestRedisJSONBadValuesRefused(t *testing.T) {
	cases := []struct {
		name string
		set  func(*RedisConfig)
	}{
		{"negative dial_timeout", func(c *RedisConfig) { c.DialTimeout = caddy.Duration(-time.Second) }},
		{"negative check_interval", func(c *RedisConfig) { c.CheckInterval = caddy.Duration(-time.Second) }},
		{"negative wait_timeout", func(c *RedisConfig) { c.WaitReplicas = 1; c.WaitTimeout = caddy.Duration(-time.Second) }},
		{"max_retries below -1", func(c *RedisConfig) { c.MaxRetries = -5 }},
		// accepted, it failed only at the first dial
		{"port out of range", func(c *RedisConfig) { c.Addresses = []string{"127.0.0.1:99999"} }},
		{"port out of range in the URL", func(c *RedisConfig) { c.Addresses, c.URL = nil, "redis://:pw@127.0.0.1:70000" }},
		// the Sentinel client was made and cluster silently left out
		{"cluster with sentinel", func(c *RedisConfig) { c.Cluster, c.Sentinel = true, "m" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rc := &RedisConfig{Addresses: []string{"127.0.0.1:7000"}}
			tc.set(rc)
			if err := redisSettingsErr(rc); err == nil {
				t.Fatalf("%s accepted", tc.name)
			}
		})
	}
}

// A bad writer, fallback or namespace is refused by the Caddyfile adapter,
// with the file and line (it was once refused only at load, by Validate).
func TestBadValuesNameFileAndLine(t *testing.T) {
	cases := []struct{ name, line string }{
		{"writer", "writer bogus"},
		{"fallback", "fallback remote"},
		{"namespace", "namespace a:b"},
		{"channel", "channel user:{query.id"},
		{"principal", "principal {query.user"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + tc.line + "\n\t}\n}\n"
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
			if err == nil || !strings.Contains(err.Error(), "Caddyfile.test:4") {
				t.Fatalf("%q: error %v, want one naming Caddyfile.test:4", tc.line, err)
			}
		})
	}
}

// The hub pool key holds the CA file's contents, not only its path: after
// the CA file is rotated, a reload gets a hub that trusts the new one.
func TestHubKeyTracksCAContents(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ca.pem")
	key := func() string {
		h := validHandler()
		h.logger = zap.NewNop()
		h.Redis = &RedisConfig{URL: "redis://127.0.0.1:7000", TLS: &RedisTLS{CA: path}}
		_, k, err := h.redisOptions()
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	writeTestCA(t, path)
	before := key()
	writeTestCA(t, path)
	if after := key(); after == before {
		t.Fatal("a new CA file gives the same hub key: a reload keeps the hub that trusts the old CA")
	}
}

// writeTestCA writes a new CA certificate to path.
func writeTestCA(t *testing.T, path string) {
	t.Helper()
	data, err := os.ReadFile(newTestPKI(t).CA)
	if err == nil {
		err = os.WriteFile(path, data, 0o600)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// lease_ttl is renewed every max(ttl/3, 10ms) (pubsub/redis_leases.go) and
// sent to Redis in whole milliseconds: a tiny one lets leases lapse between
// renewals, and the per-principal cap would not hold. Under 100ms is refused.
func TestTinyLeaseTTLRefused(t *testing.T) {
	h := validHandler()
	h.Principal = "{http.request.header.X-User}"
	h.MaxConnectionsPerPrincipal = 2
	h.LeaseTTL = caddy.Duration(500 * time.Microsecond)
	if err := h.Validate(); err == nil {
		t.Fatal("lease_ttl 500µs accepted")
	}
}

// Writing the documented default prefix ("prefix sse:") on one route and
// leaving it out on another names the same Redis and the same keys: one
// hub (the key once held the raw Prefix, "" against "sse:").
func TestExplicitDefaultPrefixSharesHub(t *testing.T) {
	key := func(prefix string) string {
		h := validHandler()
		h.logger = zap.NewNop()
		h.Redis = &RedisConfig{URL: "redis://127.0.0.1:7000", Prefix: prefix}
		_, k, err := h.redisOptions()
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	if a, b := key(""), key("sse:"); a != b {
		t.Fatalf("the default prefix, written or not, gives two hubs:\n%s\n%s", a, b)
	}
}

// A Redis on the same host is often reached by its Unix socket: a unix://
// URL works end to end (it was refused: "not host:port").
func TestRedisUnixSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "redis.sock")
	rds := redistest.Start(t, "--unixsocket", sock, "--unixsocketperm", "700")
	assertFirstEventGoesThroughRedis(t, startCaddy(t, redisSite("unix://"+sock)), rds, "over the socket")
}

// A unix:// URL names one server, at an absolute path and no host.
func TestRedisUnixSocketMistakesRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		rc   RedisConfig
	}{
		{"cluster", RedisConfig{URL: "unix:///run/redis.sock", Cluster: true}},
		{"sentinel", RedisConfig{URL: "unix:///run/redis.sock", Sentinel: "m"}},
		// go-redis reads it as /redis.sock
		{"a host", RedisConfig{URL: "unix://run/redis.sock"}},
		{"no path", RedisConfig{URL: "unix://"}},
		{"a socket and another address", RedisConfig{Addresses: []string{"/run/redis.sock", "127.0.0.1:7000"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := redisSettingsErr(&tc.rc); err == nil {
				t.Fatalf("%s accepted", tc.name)
			}
		})
	}
}
