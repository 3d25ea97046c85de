package caddysse

import (
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Handler)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	sse [<matcher>] {
//		channel <template>...           # repeatable; e.g. user:{http.auth.user.id}
//		namespace <name>
//		heartbeat <duration>|off        # default 15s
//		retry <duration>                # default 3s
//		history <count> [<max_age>]     # default 1000 events, 24h each
//		history_bytes <size>            # default 4MiB per channel
//		replay_limit <n>                # default 1000
//		max_channels <n>                # default 32
//		close_jitter <duration>|off     # default 5s
//		max_event_size <size>           # default 64KiB
//		queue <n>                       # default 500 events
//		queue_bytes <size>              # default 1MiB
//		slow_client_timeout <duration>  # default 30s
//		principal <template>            # e.g. {http.auth.user.id}
//		max_connections <n>             # per instance; default no cap
//		max_connections_per_principal <n>  # default no cap
//		lease_ttl <duration>            # default 15s (shared backends only)
//		rejections status|in_stream     # default status
//		throttle <duration>|off         # default 60s
//		publish {
//			secret <token>              # e.g. {env.SSE_PUBLISH_SECRET}
//		}
//		redis <url>                     # or a block:
//		redis {
//			url <url> | addresses <host:port>...
//			cluster                     # force cluster mode for one endpoint
//			sentinel <master-name>      # addresses are then Sentinels
//			sentinel_username <user>    # the Sentinels' own credentials
//			sentinel_password <password>
//			username <user>
//			password <password>         # e.g. {env.REDIS_PASSWORD}
//			db <n>                      # default 0
//			tls [<ca-file>]             # or a block:
//			tls {
//				ca <ca-file>
//				client_auth <cert-file> <key-file>
//				server_name <name>
//			}
//			prefix <prefix>             # default sse:
//			wait_replicas <n> [<timeout>]
//			pool_size <n>
//			dial_timeout|read_timeout|write_timeout <duration>
//			max_retries <n>             # -1: never
//			min_retry_backoff|max_retry_backoff <duration>
//			check_interval <duration>   # default 5s
//		}
//		fallback local                  # deliver locally while Redis is down
//		writer net_http|takeover        # default net_http
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for d.NextBlock(0) {
		name := d.Val()
		if seen[name] && name != "channel" {
			return d.Errf("%s is given more than once", name)
		}
		seen[name] = true
		if err := h.unmarshalSubdirective(d, name); err != nil {
			return err
		}
	}
	return h.validateParsed(d)
}

// validateParsed refuses settings that conflict with each other or with a
// default (max_event_size over the default history_bytes, fallback local
// without redis, ...), naming the sse directive's line: Validate refuses
// them too, but when the config loads, naming neither the file nor which
// sse block, and `caddy adapt` passed them.
func (h *Handler) validateParsed(d *caddyfile.Dispenser) error {
	parsed := *h
	parsed.applyDefaults()
	if err := parsed.Validate(); err != nil {
		d.Reset()
		d.Next() // the directive's name
		return d.WrapErr(err)
	}
	return nil
}

func (h *Handler) unmarshalSubdirective(d *caddyfile.Dispenser, name string) error {
	switch name {
	case "channel":
		args := d.RemainingArgs()
		if len(args) == 0 {
			return d.ArgErr()
		}
		for _, tmpl := range args {
			if err := checkChannelTemplate(tmpl); err != nil {
				return d.Err(err.Error())
			}
		}
		h.Channels = append(h.Channels, args...)
		return nil
	case "namespace":
		if err := oneString(d, &h.Namespace); err != nil {
			return err
		}
		if h.Namespace == "" {
			return nil // e.g. an unset {$TENANT}: no namespace
		}
		if err := validateNamespace(h.Namespace); err != nil {
			return d.Err(err.Error())
		}
		return nil
	case "heartbeat":
		return durationOrOff(d, &h.Heartbeat)
	case "retry":
		return oneDuration(d, &h.Retry)
	case "history":
		return h.unmarshalHistory(d)
	case "history_bytes":
		return oneSize(d, &h.HistoryBytes)
	case "replay_limit":
		return oneInt(d, &h.ReplayLimit)
	case "max_channels":
		if err := oneInt(d, &h.MaxChannels); err != nil {
			return err
		}
		if err := checkMaxChannels(h.MaxChannels); err != nil {
			return d.Err(err.Error()) // Validate refuses it too, without the line
		}
		return nil
	case "close_jitter":
		return durationOrOff(d, &h.CloseJitter)
	case "max_event_size":
		return oneSize(d, &h.MaxEventSize)
	case "queue":
		return oneInt(d, &h.Queue)
	case "queue_bytes":
		return oneSize(d, &h.QueueBytes)
	case "slow_client_timeout":
		return oneDuration(d, &h.SlowClientTimeout)
	case "principal":
		if err := oneString(d, &h.Principal); err != nil {
			return err
		}
		if err := checkPrincipalTemplate(h.Principal); err != nil {
			return d.Err(err.Error())
		}
		return nil
	case "max_connections":
		return oneInt(d, &h.MaxConnections)
	case "max_connections_per_principal":
		return oneInt(d, &h.MaxConnectionsPerPrincipal)
	case "lease_ttl":
		if err := oneDuration(d, &h.LeaseTTL); err != nil {
			return err
		}
		if err := checkLeaseTTL(time.Duration(h.LeaseTTL)); err != nil {
			return d.Err(err.Error()) // Validate refuses it too, without the line
		}
		return nil
	case "rejections":
		return h.unmarshalRejections(d)
	case "throttle":
		return durationOrOff(d, &h.Throttle)
	case "publish":
		return h.unmarshalPublish(d)
	case "redis":
		h.Redis = new(RedisConfig)
		return h.Redis.unmarshalCaddyfile(d)
	case "fallback":
		return oneOf(d, &h.Fallback, fallbackLocal)
	case "writer":
		return oneOf(d, &h.Writer, writerNetHTTP, writerTakeover)
	default:
		return d.Errf("unrecognized sse subdirective %q", name)
	}
}

func (h *Handler) unmarshalHistory(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) < 1 || len(args) > 2 {
		return d.ArgErr()
	}
	n, err := strconv.Atoi(args[0])
	if err != nil || n <= 0 {
		return d.Errf("history: count must be a positive integer, got %q", args[0])
	}
	h.HistorySize = n
	if len(args) == 2 {
		age, err := caddy.ParseDuration(args[1])
		if err != nil || age < time.Millisecond {
			// Redis is given it in whole milliseconds, and refuses 0
			return d.Errf("history: max age must be a duration of at least 1ms, got %q", args[1])
		}
		h.HistoryMaxAge = caddy.Duration(age)
	}
	return nil
}

func (h *Handler) unmarshalRejections(d *caddyfile.Dispenser) error {
	if err := oneString(d, &h.Rejections); err != nil {
		return err
	}
	if h.Rejections != rejectionsStatus && h.Rejections != rejectionsInStream {
		return d.Errf("rejections: must be %s or %s, got %q", rejectionsStatus, rejectionsInStream, h.Rejections)
	}
	return nil
}

func (h *Handler) unmarshalPublish(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	h.Publish = new(PublishConfig)
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := onceIn(d, seen, "publish"); err != nil {
			return err
		}
		switch d.Val() {
		case "secret":
			if err := oneString(d, &h.Publish.Secret); err != nil {
				return err
			}
		default:
			return d.Errf("unrecognized publish subdirective %q", d.Val())
		}
	}
	if h.Publish.Secret == "" {
		return d.Err("publish: a secret is required")
	}
	return nil
}

func oneString(d *caddyfile.Dispenser, dst *string) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	*dst = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

func oneInt(d *caddyfile.Dispenser, dst *int) error { return oneIntFrom(d, dst, 1) }

// oneNonNegative reads a single integer that may be 0.
func oneNonNegative(d *caddyfile.Dispenser, dst *int) error { return oneIntFrom(d, dst, 0) }

// oneIntFrom reads a single integer of at least least (0 or 1).
func oneIntFrom(d *caddyfile.Dispenser, dst *int, least int) error {
	name := d.Val()
	var s string
	if err := oneString(d, &s); err != nil {
		return err
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < least {
		what := "positive"
		if least == 0 {
			what = "non-negative"
		}
		return d.Errf("%s: must be a %s integer, got %q", name, what, s)
	}
	*dst = n
	return nil
}

// oneOf reads a single argument that must be one of choices.
func oneOf(d *caddyfile.Dispenser, dst *string, choices ...string) error {
	name := d.Val()
	if err := oneString(d, dst); err != nil {
		return err
	}
	for _, c := range choices {
		if *dst == c {
			return nil
		}
	}
	return d.Errf("%s: %q is not one of %s", name, *dst, strings.Join(choices, ", "))
}

// onceIn refuses a subdirective given twice in one block: the later one
// would silently win.
func onceIn(d *caddyfile.Dispenser, seen map[string]bool, block string) error {
	if seen[d.Val()] {
		return d.Errf("%s: %s is given more than once", block, d.Val())
	}
	seen[d.Val()] = true
	return nil
}

func oneDuration(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	name := d.Val()
	var s string
	if err := oneString(d, &s); err != nil {
		return err
	}
	v, err := caddy.ParseDuration(s)
	if err != nil || v <= 0 {
		return d.Errf("%s: must be a positive duration, got %q", name, s)
	}
	*dst = caddy.Duration(v)
	return nil
}

// durationOrOff parses a duration or "off", stored as a negative duration.
func durationOrOff(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	if d.CountRemainingArgs() == 1 && d.NextArg() {
		if d.Val() == "off" {
			*dst = -1
			return nil
		}
		d.Prev()
	}
	return oneDuration(d, dst)
}

func oneSize(d *caddyfile.Dispenser, dst *int64) error {
	name := d.Val()
	var s string
	if err := oneString(d, &s); err != nil {
		return err
	}
	v, err := humanize.ParseBytes(s)
	if err != nil || v == 0 || v > maxSize {
		return d.Errf("%s: must be a positive size such as 64KiB, got %q", name, s)
	}
	*dst = int64(v)
	return nil
}
