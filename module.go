// Package caddysse is a Caddy HTTP handler that holds Server-Sent Events
// streams at the proxy layer. Backends publish events with a POST (or,
// later, straight into Redis); Caddy keeps the connections, sends
// heartbeats, replays what a reconnecting client missed from its
// Last-Event-ID, and tells clients to reconnect before a reload or shutdown.
package caddysse

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("sse", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("sse", httpcaddyfile.Before, "reverse_proxy")
}

// Defaults of the handler's settings.
const (
	DefaultHeartbeat         = 15 * time.Second
	DefaultRetry             = 3 * time.Second
	DefaultHistorySize       = 1000
	DefaultHistoryMaxAge     = 24 * time.Hour
	DefaultHistoryBytes      = 4 << 20
	DefaultReplayLimit       = 1000
	DefaultMaxChannels       = 32
	DefaultCloseJitter       = 5 * time.Second
	DefaultMaxEventSize      = 64 << 10
	DefaultQueue             = 500
	DefaultQueueBytes        = 1 << 20
	DefaultSlowClientTimeout = 30 * time.Second
	DefaultThrottle          = 60 * time.Second
	DefaultLeaseTTL          = 15 * time.Second
	minLeaseTTL              = 100 * time.Millisecond
)

// Handler serves Server-Sent Events: a GET (or HEAD) opens a stream of the
// channels named by Channels, a POST with a bearer secret publishes an event
// (when Publish is set). All handlers of a process without Redis share one
// embedded hub (and those with the same Redis settings one Redis hub), so
// an event published on one route or site reaches the subscribers of every
// other.
type Handler struct {
	// Channels are the templates of the channels a stream subscribes to.
	// Request placeholders are replaced per request, for example
	// "user:{http.auth.user.id}" or "{http.request.uri.query.channels}".
	// Commas in a template's text separate channels; a placeholder whose
	// value is a comma-separated list (or a repeated query parameter) names
	// one channel per item, each with the template's text around it:
	// "public:{http.request.uri.query.topics}" with topics=a,b is public:a
	// and public:b. A template with an empty or unknown placeholder rejects
	// the request with 403 channel_unresolved. A brace that opens or closes
	// no placeholder is a configuration error. Without channels the route
	// only publishes.
	Channels []string `json:"channels,omitempty"`

	// Namespace prefixes every channel of this handler (as
	// "<namespace>:<channel>"), for subscribing and publishing alike, to keep
	// tenants or sites apart on one hub. It may not contain ":".
	Namespace string `json:"namespace,omitempty"`

	// Heartbeat is how long a stream may stay silent before it is sent a
	// comment line, so that proxies and load balancers do not cut idle
	// streams. Default: 15s. A negative value turns heartbeats off.
	Heartbeat caddy.Duration `json:"heartbeat,omitempty"`

	// Retry is the reconnection delay sent to clients at the start of every
	// stream ("retry:" field). Default: 3s.
	Retry caddy.Duration `json:"retry,omitempty"`

	// HistorySize is how many events are kept per channel for replay after
	// a reconnect. Default: 1000.
	HistorySize int `json:"history_size,omitempty"`

	// HistoryMaxAge is how long each event is kept for replay. Default: 24h;
	// at least 1ms (Redis counts it in milliseconds).
	HistoryMaxAge caddy.Duration `json:"history_max_age,omitempty"`

	// HistoryBytes bounds the size of a channel's kept events, so that a few
	// large events cannot hold a lot of memory. Default: 4 MiB. It must be at
	// least MaxEventSize plus 264 bytes (the largest event type and an
	// entry's own cost).
	HistoryBytes int64 `json:"history_bytes,omitempty"`

	// ReplayLimit is the most events replayed per channel to a client that
	// reconnects with a Last-Event-ID. A client that missed more is told
	// that its replay was truncated and gets the newest ones. Default: 1000.
	ReplayLimit int `json:"replay_limit,omitempty"`

	// MaxChannels is the most channels one stream may subscribe to (after
	// templates are resolved and split), and one publish may name.
	// Default: 32. At most 423, so that a stream's Last-Event-ID (a
	// position per channel) stays under 16 KiB. A stream whose reconnect
	// (its URL and headers with a Last-Event-ID for every channel) would
	// not fit the server's max_header_size is refused too: a browser's
	// EventSource would give up for good on the 431 its reconnect got.
	MaxChannels int `json:"max_channels,omitempty"`

	// CloseJitter spreads the reconnections after a reload or shutdown: each
	// stream is sent a reconnection delay drawn at random up to this long
	// along with its server_closing event. Default: 5s. A negative value
	// sends no delay (clients reconnect at once).
	CloseJitter caddy.Duration `json:"close_jitter,omitempty"`

	// MaxEventSize is the largest event data a publish may carry, in bytes;
	// larger ones are rejected with 413. Default: 64 KiB.
	MaxEventSize int64 `json:"max_event_size,omitempty"`

	// Queue is how many events may wait to be written to one stream. A
	// stream whose queue overflows stops taking live events and catches up
	// from the history once it has drained, so it never misses one.
	// Default: 500.
	Queue int `json:"queue,omitempty"`

	// QueueBytes bounds the size of the events waiting for one stream (an
	// empty queue takes any one event). Default: 1 MiB. It must be at least
	// MaxEventSize.
	QueueBytes int64 `json:"queue_bytes,omitempty"`

	// SlowClientTimeout is how long one write to a stream may block, or its
	// queue stay overflowed, before the stream is ended as a slow client
	// (and the client throttled, see Throttle). It replaces the server's
	// write timeouts for streams, which would otherwise cut every long
	// stream. Default: 30s.
	SlowClientTimeout caddy.Duration `json:"slow_client_timeout,omitempty"`

	// Principal is the template of who owns a stream, used for the
	// per-principal cap and for throttling, for example
	// "{http.auth.user.id}" or "{http.request.header.X-Wallet}" set by an
	// authentication module or forward_auth. It is resolved per request
	// like Channels; a stream whose principal does not resolve (or
	// resolves to an invalid name) is refused with 401
	// principal_unresolved, before any other check.
	Principal string `json:"principal,omitempty"`

	// MaxConnections caps the streams open on this instance: a stream that
	// would exceed it is refused with 503 server_full. The count is of
	// every stream this Caddy process holds on the handler's backend (all
	// sites and routes sharing the hub, old configs' streams included
	// while they close after a reload); each handler compares it with its
	// own cap. Default: no cap.
	MaxConnections int `json:"max_connections,omitempty"`

	// MaxConnectionsPerPrincipal caps the streams of one principal: a
	// stream that would exceed it is refused with 429 too_many_connections.
	// The cap holds on this instance with the embedded hub, and across all
	// instances with a shared backend. It requires Principal. Default: no
	// cap.
	MaxConnectionsPerPrincipal int `json:"max_connections_per_principal,omitempty"`

	// LeaseTTL is how long a stream's share of its principal's cap outlives
	// an instance that dies without giving it back, so that the principal
	// is admitted elsewhere within that time. Only a backend shared by
	// several instances (Redis) uses it: the embedded hub's leases end with
	// the process. Default: 15s; at least 100ms.
	LeaseTTL caddy.Duration `json:"lease_ttl,omitempty"`

	// Rejections chooses how temporary refusals of a stream (429 throttled
	// and too_many_connections, 503 server_full and other 503s) are
	// answered: "status" (the default) answers with the status code and a
	// JSON body; "in_stream" answers with a 200 stream that sends
	// "retry: <Retry-After in ms>" and one sse_rejected event carrying the
	// same JSON, then ends, so that a browser's EventSource retries after
	// that delay instead of giving up as it does on any non-200.
	// Configuration-level refusals (400, 401, 403, 405) are status codes
	// either way.
	Rejections string `json:"rejections,omitempty"`

	// Throttle is how long a client disconnected for being slow is refused
	// with 429 throttled: its principal from its remote address (so that
	// another device of the same user is not punished), or the remote
	// address alone without a principal. Default: 60s; at most 24h with
	// Redis (its announcement to the other instances is kept that long). A
	// negative value turns throttling off.
	Throttle caddy.Duration `json:"throttle,omitempty"`

	// Redis connects the handler to Redis: events reach the subscribers of
	// every instance on the same Redis, and a client can resume on any of
	// them. Without it the handler uses this process's embedded hub.
	Redis *RedisConfig `json:"redis,omitempty"`

	// Fallback is what a publish does while Redis is unreachable. By
	// default it fails with 503 and Retry-After, so that the publisher
	// retries and no instance misses the event. "local" delivers it to this
	// instance's streams only, under a local epoch, so that any cursor that
	// includes such an event is later answered as truncated.
	Fallback string `json:"fallback,omitempty"`

	// Writer chooses how streams are written. "net_http" (the default)
	// keeps each stream on net/http and Caddy's response pipeline, with a
	// goroutine per stream. "takeover" takes HTTP/1.1 connections (cleartext
	// and TLS) over once a stream's headers are decided and watches them
	// from one event loop per CPU (Linux; elsewhere it is net_http): an
	// idle stream then costs a few KiB instead of tens, and fan-out far less
	// CPU; where the kernel allows io_uring (unless the environment sets
	// CADDY_SSE_IO_URING=0) a loop sends its streams' writes with one
	// system call per 128 streams. HTTP/2 and HTTP/3 streams stay on net/http. A taken-over stream has
	// left Caddy's response pipeline: the access log records the hand-off
	// (its duration and the bytes written until then), and response
	// handlers after this one do not see it.
	Writer string `json:"writer,omitempty"`

	// Publish enables publishing with a POST to this route.
	Publish *PublishConfig `json:"publish,omitempty"`

	logger  *zap.Logger
	hub     *pubsub.Hub
	loops   *loopSet  // the takeover writer's event loops, if used
	steps   *stepPool // starts the streams that keep their handler goroutine (stack.go)
	drainer *drainer  // writes every stream no event loop writes (drainer.go)

	channelTemplates  []template
	principalTemplate template
	loopsOn           bool // a reference to them is held
	closedByServer    bool // its server's shutdown hook tells its streams (closeStreamsOnShutdown)
	cleanedUp         bool // Cleanup ran
	hubKey            string
	publishing        *inFlight // publishes in flight: the hub is released after them
	hubLogs           func()    // gives back the logger the hub was handed (useHubLogger)
	streams           *registry
	secret            []byte // the SHA-256 digest of the publish secret
	limits            replay.Limits
	metrics           *metrics
	warnings          *warnings // those that can come per request, rate-limited
	// clock is this instance's clock (nil: time.Now); a test sets it to an
	// instance whose clock is off the hub's
	clock func() time.Time
}

// now reads the instance's clock.
func (h *Handler) now() time.Time {
	if h.clock != nil {
		return h.clock()
	}
	return time.Now()
}

// PublishConfig enables publishing on a route.
type PublishConfig struct {
	// Secret is the bearer token a publisher must send as
	// "Authorization: Bearer <secret>". Global placeholders such as
	// {env.SSE_PUBLISH_SECRET} are replaced when the config is loaded; an
	// empty secret is a configuration error, so that an unset variable can
	// never open publishing to anyone.
	Secret string `json:"secret,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.sse",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision applies defaults, resolves the publish secret and takes a
// reference to the shared hub. It touches no network.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	h.warnings = new(warnings)
	h.publishing = new(inFlight)
	h.applyDefaults()
	if err := h.provisionSecret(); err != nil {
		return err
	}
	h.limits = h.hubLimits()
	h.channelTemplates = make([]template, len(h.Channels))
	for i, raw := range h.Channels {
		h.channelTemplates[i] = compileTemplate(raw)
	}
	h.principalTemplate = compileTemplate(h.Principal)
	m, err := acquireMetrics(ctx.GetMetricsRegistry())
	if err != nil {
		return err
	}
	h.metrics = m
	redisOpts, key, err := h.redisOptions()
	if err != nil {
		return err
	}
	hub, key, err := acquireHub(redisOpts, key)
	if err != nil {
		return err
	}
	h.hub, h.hubKey = hub, key
	h.useHubLogger(redisOpts)
	if h.Writer == writerTakeover {
		if h.loops, err = acquireLoops(); err != nil {
			return err
		}
		h.loopsOn = true
		if h.loops != nil {
			h.logger.Info("sse_takeover_writer", zap.String("sends", h.loops.sendsBy()))
		}
	}
	h.streams = newRegistry(h.logger, h.heartbeat(), h.closeJitter(), time.Duration(h.SlowClientTimeout))
	h.steps = newStepPool()
	h.drainer = newDrainer()
	if h.closedByServer = h.closeStreamsOnShutdown(ctx); h.closedByServer {
		return nil
	}
	return h.closeStreamsWhenStopping(ctx)
}

// fallbackLocal is the one value of Handler.Fallback.
const fallbackLocal = "local"

// redisOptions returns the broker options and pool key of the handler's
// Redis, or nil for the embedded hub.
func (h *Handler) redisOptions() (*pubsub.RedisOptions, string, error) {
	if h.Redis == nil {
		return nil, "", nil
	}
	opts, err := h.Redis.redisOptions()
	if err != nil {
		return nil, "", err
	}
	opts.Logger = h.logger.Named("redis")
	return &opts, hubKeyOf(opts, h.Redis.TLS, h.Redis.tlsSum), nil
}

// useHubLogger makes a Redis hub log through this handler's logger while
// it is the newest user: the hub outlives the config that made it, and
// must log as the running config says (its outputs, its level).
func (h *Handler) useHubLogger(redisOpts *pubsub.RedisOptions) {
	if rb, ok := h.hub.Broker().(*pubsub.Redis); ok && redisOpts != nil {
		h.hubLogs = rb.UseLogger(redisOpts.Logger)
	}
}

// hubLimits are the history bounds this handler publishes with.
func (h *Handler) hubLimits() replay.Limits {
	return replay.Limits{
		Count:    h.HistorySize,
		MaxAge:   time.Duration(h.HistoryMaxAge),
		MaxBytes: h.HistoryBytes,
	}
}

func (h *Handler) applyDefaults() {
	setDefault(&h.Heartbeat, caddy.Duration(DefaultHeartbeat))
	setDefault(&h.Retry, caddy.Duration(DefaultRetry))
	setDefault(&h.HistorySize, DefaultHistorySize)
	setDefault(&h.HistoryMaxAge, caddy.Duration(DefaultHistoryMaxAge))
	setDefault(&h.HistoryBytes, DefaultHistoryBytes)
	setDefault(&h.ReplayLimit, DefaultReplayLimit)
	setDefault(&h.MaxChannels, DefaultMaxChannels)
	setDefault(&h.CloseJitter, caddy.Duration(DefaultCloseJitter))
	setDefault(&h.MaxEventSize, DefaultMaxEventSize)
	setDefault(&h.Queue, DefaultQueue)
	setDefault(&h.QueueBytes, DefaultQueueBytes)
	setDefault(&h.SlowClientTimeout, caddy.Duration(DefaultSlowClientTimeout))
	setDefault(&h.Throttle, caddy.Duration(DefaultThrottle))
	setDefault(&h.LeaseTTL, caddy.Duration(DefaultLeaseTTL))
	setDefault(&h.Rejections, rejectionsStatus)
}

func setDefault[T comparable](field *T, value T) {
	var zero T
	if *field == zero {
		*field = value
	}
}

func (h *Handler) provisionSecret() error {
	if h.Publish == nil {
		return nil
	}
	secret, err := caddy.NewReplacer().ReplaceOrErr(h.Publish.Secret, true, true)
	switch {
	case err != nil && strings.Contains(err.Error(), "unrecognized placeholder"):
		// not the placeholder itself: it is part of the secret
		return errors.New("publish: the secret holds a placeholder that is not known at load; only global ones such as {env.NAME} are replaced")
	case err != nil || strings.TrimSpace(secret) == "":
		return errors.New("publish: the secret is empty (is its environment variable set?); an empty secret would let anyone publish")
	}
	// a header cannot carry the whitespace around a secret (a newline
	// left by an env file, a mounted secret): kept, it could never match
	sum := sha256.Sum256([]byte(strings.TrimSpace(secret)))
	h.secret = sum[:]
	return nil
}

// closeStreamsWhenStopping ends the streams of a handler outside an HTTP
// server as soon as Caddy begins to stop this config (reload or exit):
// graceful shutdowns wait for every open request, eternally by default,
// and Cleanup runs only after them, so waiting for Cleanup would never end.
func (h *Handler) closeStreamsWhenStopping(ctx caddy.Context) error {
	app, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("loading events app: %v", err)
	}
	events, ok := app.(*caddyevents.App)
	if !ok {
		return fmt.Errorf("events app has unexpected type %T", app)
	}
	return events.On("stopping", stoppingHook{h.streams})
}

// closeStreamsOnShutdown makes the handler's HTTP server tell its streams
// that it is closing when its shutdown begins, once it has closed its
// listeners; false if the handler is not provisioned in an HTTP server.
// Caddy shuts that server down on every stop and reload, HTTP/3 or not
// (its HTTP/3 server stops beside it), so this covers every stream.
//
// Caddy's "stopping" event comes earlier, while the old server still
// accepts connections: Caddy binds each config's listening socket with
// SO_REUSEPORT, so a client told then and reconnecting at once may reach
// the old socket, and net/http closes a connection whose request it reads
// after its shutdown has begun without a response (35 of 10k streams in a
// reconnect storm, docs/PERFORMANCE.md). Told here, every reconnect
// reaches the new server. It also keeps streams open through the http
// app's shutdown_delay, as the rest of the server.
func (h *Handler) closeStreamsOnShutdown(ctx caddy.Context) bool {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return false
	}
	streams := h.streams
	srv.RegisterOnShutdown(func() { streams.closeAll(stopReason()) })
	srv.RegisterConnContext(rememberConn)
	return true
}

// stoppingHook closes a handler's streams on Caddy's "stopping" event.
type stoppingHook struct{ streams *registry }

// Handle tells every stream that the server is closing.
func (s stoppingHook) Handle(_ context.Context, _ caddy.Event) error {
	s.streams.closeAll(stopReason())
	// taken-over streams are no longer requests that the servers' shutdown
	// waits for: give their loops a moment to tell them before the process
	// may exit
	s.streams.waitTakenOver(takenOverGrace)
	return nil
}

// stopReason says why streams are closed: the process exits, or a new
// config replaces this one.
func stopReason() string {
	if caddy.Exiting() {
		return reasonShutdown
	}
	return reasonReload
}

// The reasons a server_closing gives.
const (
	reasonReload   = "reload"
	reasonShutdown = "shutdown"
)

// Validate checks the configuration. It is read-only.
func (h *Handler) Validate() error {
	if len(h.Channels) == 0 && h.Publish == nil {
		return errors.New("nothing to do: configure at least one channel or a publish block")
	}
	for _, tmpl := range h.Channels {
		if strings.TrimSpace(tmpl) == "" {
			return errors.New("channel: empty template")
		}
		if err := checkChannelTemplate(tmpl); err != nil {
			return err
		}
		for _, item := range constantItems(tmpl) {
			if err := h.validateChannel(strings.TrimSpace(item)); err != nil {
				return fmt.Errorf("channel %q: %v", tmpl, err) // with the namespace: refused at every request
			}
		}
	}
	if h.Principal != "" && strings.TrimSpace(h.Principal) == "" {
		return errors.New("principal: empty template")
	}
	if err := checkPrincipalTemplate(h.Principal); err != nil {
		return err
	}
	switch h.Writer {
	case "", writerNetHTTP, writerTakeover:
	default:
		return fmt.Errorf("writer %q: use %q or %q", h.Writer, writerNetHTTP, writerTakeover)
	}
	switch {
	case h.Fallback != "" && h.Fallback != fallbackLocal:
		return fmt.Errorf("fallback %q: the only fallback is %q", h.Fallback, fallbackLocal)
	case h.Fallback == fallbackLocal && h.Redis == nil:
		return errors.New("fallback local needs redis: the embedded hub has nothing to fall back from")
	}
	if h.Redis != nil && time.Duration(h.Throttle) > pubsub.MaxRedisThrottle {
		// its announcement to the other instances is kept no longer
		return fmt.Errorf("throttle: at most %v with redis, got %v", pubsub.MaxRedisThrottle, time.Duration(h.Throttle))
	}
	if h.Namespace != "" {
		if err := validateNamespace(h.Namespace); err != nil {
			return err
		}
	}
	return h.validateLimits()
}

// maxSize bounds the byte sizes (max_event_size, history_bytes,
// queue_bytes), in the Caddyfile and in JSON alike: the checks and the
// publish body limit add to them and multiply them, and must not wrap.
const maxSize = 1 << 40

func (h *Handler) validateLimits() error {
	for _, s := range []struct {
		name string
		v    int64
	}{{"max_event_size", h.MaxEventSize}, {"history_bytes", h.HistoryBytes}, {"queue_bytes", h.QueueBytes}} {
		if s.v > maxSize {
			return fmt.Errorf("%s: at most 1TiB, got %d", s.name, s.v)
		}
	}
	checks := []struct {
		ok  bool
		msg string
	}{
		{h.Retry >= 0, "retry must not be negative"},
		{h.HistorySize > 0, "history size must be positive"},
		// Redis is given the age in whole milliseconds: under one, 0, which
		// it refuses at every publish
		{h.HistoryMaxAge >= caddy.Duration(time.Millisecond), "history max age must be at least 1ms"},
		{h.ReplayLimit > 0, "replay_limit must be positive"},
		{h.MaxChannels > 0, "max_channels must be positive"},
		{h.MaxEventSize > 0, "max_event_size must be positive"},
		{h.HistoryBytes >= h.MaxEventSize+wire.MaxEventTypeLen+pubsub.EntryOverhead,
			fmt.Sprintf("history_bytes must be at least max_event_size plus %d bytes (the largest event type, and an entry's own cost)", wire.MaxEventTypeLen+pubsub.EntryOverhead)},
		{h.Queue > 0, "queue must be positive"},
		{h.QueueBytes >= h.MaxEventSize, "queue_bytes must be at least max_event_size"},
		{h.SlowClientTimeout > 0, "slow_client_timeout must be positive"},
		{h.MaxConnections >= 0, "max_connections must not be negative"},
		{h.MaxConnectionsPerPrincipal >= 0, "max_connections_per_principal must not be negative"},
		{h.MaxConnectionsPerPrincipal == 0 || h.Principal != "", "max_connections_per_principal needs a principal"},
		{h.Rejections == rejectionsStatus || h.Rejections == rejectionsInStream, "rejections must be status or in_stream"},
	}
	for _, c := range checks {
		if !c.ok {
			return errors.New(c.msg)
		}
	}
	if err := checkMaxChannels(h.MaxChannels); err != nil {
		return err
	}
	return checkLeaseTTL(time.Duration(h.LeaseTTL))
}

// checkMaxChannels and checkLeaseTTL are the bounds of one setting each,
// which the Caddyfile checks too, to name the line.
func checkMaxChannels(n int) error {
	if n > replay.MaxCursorChannels {
		return fmt.Errorf("max_channels: at most %d, got %d (a stream's Last-Event-ID holds a position for each of its channels and must stay under %d bytes)",
			replay.MaxCursorChannels, n, replay.MaxCursorLen)
	}
	return nil
}

func checkLeaseTTL(d time.Duration) error {
	if d < minLeaseTTL {
		return fmt.Errorf("lease_ttl: at least %v, got %v (leases are renewed every third of it)", minLeaseTTL, d)
	}
	return nil
}

// Cleanup ends this handler's streams and releases its reference to the
// hub, which lives on while another config (e.g. the one a reload brought
// in) still uses it. It copes with a Provision that stopped halfway.
func (h *Handler) Cleanup() error {
	if h.cleanedUp {
		return nil // what it held is released once: the pools count each user once
	}
	h.cleanedUp = true
	if h.streams != nil {
		if h.closedByServer {
			// Caddy may clean a config up before the goroutine that shuts its
			// server down has closed the listening socket: streams told now
			// could reconnect to it (closeStreamsOnShutdown)
			h.streams.awaitClosing(shutdownHookWait)
		}
		h.streams.closeAll(stopReason())
		h.streams.waitTakenOver(takenOverGrace)
		h.streams.stop()
	}
	h.steps.stop()
	h.drainer.stop()
	if h.metrics != nil {
		releaseMetrics()
	}
	if h.loopsOn {
		releaseLoops()
	}
	if h.hubLogs != nil {
		h.hubLogs()
	}
	if h.hubKey != "" {
		key, logger := h.hubKey, h.logger
		if h.publishing != nil && h.publishing.putOff(func() {
			if err := releaseHub(key); err != nil {
				logger.Error("releasing the hub", zap.Error(err))
			}
		}) {
			return nil
		}
		return releaseHub(key)
	}
	return nil
}

func (h *Handler) heartbeat() time.Duration {
	if h.Heartbeat < 0 {
		return 0
	}
	return time.Duration(h.Heartbeat)
}

func (h *Handler) closeJitter() time.Duration {
	if h.CloseJitter < 0 {
		return 0
	}
	return time.Duration(h.CloseJitter)
}

// channelKey is a channel's name in the hub: namespaced.
func (h *Handler) channelKey(name string) string {
	if h.Namespace == "" {
		return name
	}
	return h.Namespace + ":" + name
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
	_ caddyevents.Handler         = stoppingHook{}
)
