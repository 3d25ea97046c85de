package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// redisPublisher publishes straight into Redis, as README.md documents for
// backends: FCALL sse_publish_v1 1 <prefix>{<channel>} <type> <data>
// <count> <max_age_ms> <max_bytes>. The event reaches every Caddy sharing
// the Redis with the same id as if it had been published through one of
// them. If Redis does not have the function yet (a fresh Redis before
// Caddy's first publish), it is loaded from the module's library
// (FUNCTION LOAD, as `redis-cli FUNCTION LOAD REPLACE "$(cat
// pubsub/redis.lua)"` would); where Redis refuses functions, the same code
// runs as a script (EVALSHA/EVAL), as Caddy itself falls back.
type redisPublisher struct {
	rdb     *redis.Client
	prefix  string
	limits  []any // count, max age ms, max bytes
	script  *redis.Script
	scripts atomic.Bool // functions are refused: use the script
	loads   atomic.Int64
	note    func(string) // called by close (on the caller's goroutine) with what happened, if anything
}

// the module's defaults for what the bench Caddyfile leaves unset
const (
	redisMaxAgeMs = int64(24 * time.Hour / time.Millisecond)
	redisMaxBytes = 4 << 20
)

// parseRedisURL checks that a redis:// URL points at a loopback address and
// returns its options.
func parseRedisURL(ctx context.Context, raw string) (*redis.Options, error) {
	if !strings.HasPrefix(raw, "redis://") {
		return nil, fmt.Errorf("redis URL %q: want redis:// (loopback, no TLS)", raw)
	}
	opts, err := redis.ParseURL(raw)
	if err != nil {
		return nil, fmt.Errorf("redis URL %q: %v", raw, err)
	}
	host, _, err := net.SplitHostPort(opts.Addr)
	if err != nil {
		return nil, fmt.Errorf("redis URL %q: %v", raw, err)
	}
	addrs, err := checkLoopbackHost(ctx, host, defaultLookup)
	if err != nil {
		return nil, fmt.Errorf("redis URL %q: %v", raw, err)
	}
	_, port, _ := net.SplitHostPort(opts.Addr)
	opts.Addr = net.JoinHostPort(addrs[0].Unmap().String(), port) // the checked address, never the name again
	return opts, nil
}

func newRedisPublisher(opts *redis.Options, prefix string, history, conns int, timeout time.Duration) *redisPublisher {
	o := *opts
	o.PoolSize = conns
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = timeout, timeout, timeout
	o.MaxRetries = -1 // the plan retries (idempotent plans only), like the HTTP publisher
	return &redisPublisher{
		rdb:    redis.NewClient(&o),
		prefix: prefix,
		limits: []any{history, redisMaxAgeMs, redisMaxBytes},
		script: redis.NewScript(publishScript(pubsub.RedisFunctions())),
	}
}

// publishScript turns the function library into the script form of
// sse_publish_v1 (the committed pubsub/redis_eval_publish.lua): the library
// without its shebang and registrations, then a call of publish.
func publishScript(library string) string {
	var b strings.Builder
	for _, line := range strings.Split(library, "\n") {
		if strings.HasPrefix(line, "#!lua") || strings.HasPrefix(line, "redis.register_function") {
			continue
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	b.WriteString("return publish(KEYS, ARGV)\n")
	return b.String()
}

func (p *redisPublisher) key(channel string) string { return p.prefix + "{" + channel + "}" }

func (p *redisPublisher) publish(ctx context.Context, channel, event string, data []byte, _ string) error {
	keys := []string{p.key(channel)}
	args := append([]any{event, data}, p.limits...)
	if p.scripts.Load() {
		return redisErr(p.script.Run(ctx, p.rdb, keys, args...).Err())
	}
	err := p.rdb.FCall(ctx, pubsub.FunctionPublish, keys, args...).Err()
	if err != nil && strings.Contains(err.Error(), "Function not found") {
		err = p.load(ctx)
		if err == nil {
			err = p.rdb.FCall(ctx, pubsub.FunctionPublish, keys, args...).Err()
		}
	}
	if functionsRefused(err) {
		p.scripts.Store(true)
		err = p.script.Run(ctx, p.rdb, keys, args...).Err()
	}
	return redisErr(err)
}

// load loads the module's function library. Another publisher (or Caddy)
// may have loaded it meanwhile: that is no error, and an existing library
// is not replaced.
func (p *redisPublisher) load(ctx context.Context) error {
	err := p.rdb.FunctionLoad(ctx, pubsub.RedisFunctions()).Err()
	if err != nil && strings.Contains(err.Error(), "already exists") {
		return nil
	}
	if err == nil {
		p.loads.Add(1)
	}
	return err
}

func functionsRefused(err error) bool {
	if err == nil {
		return false
	}
	msg := err.Error()
	return strings.Contains(msg, "NOPERM") || strings.Contains(msg, "unknown command") || strings.Contains(msg, "not allowed")
}

func redisErr(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("publish: redis: %s", shortErr(err))
}

// ping checks that Redis answers.
func (p *redisPublisher) ping(ctx context.Context) error { return p.rdb.Ping(ctx).Err() }

func (p *redisPublisher) close() {
	_ = p.rdb.Close()
	if p.note == nil {
		return
	}
	if p.loads.Load() > 0 {
		p.note("Redis had no " + pubsub.FunctionPublish + " yet: the module's function library was loaded (FUNCTION LOAD)")
	}
	if p.scripts.Load() {
		p.note("Redis refuses functions: published with the script form (EVALSHA/EVAL)")
	}
}
