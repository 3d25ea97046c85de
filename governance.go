package caddysse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/wire"
)

// The ways of answering a temporary refusal of a stream (Handler.Rejections).
const (
	rejectionsStatus   = "status"
	rejectionsInStream = "in_stream"
)

// minCapRetryAfter is the least Retry-After of a refusal for a cap: a
// client over its cap, or facing a full server, gains nothing by coming
// back sooner.
const minCapRetryAfter = 5 * time.Second

// client is who opens a stream: the principal as resolved ("" without one)
// and the remote address.
type client struct {
	principal string
	ip        string
}

// resolvePrincipal resolves the principal template of a request (SPEC S2
// step 1). Without a template the stream has no principal.
func (h *Handler) resolvePrincipal(r *http.Request, repl *caddy.Replacer) (string, *rejection) {
	if h.Principal == "" {
		return "", nil
	}
	value, ok := h.principalTemplate.resolve(r, repl)
	value = strings.TrimSpace(value)
	if !ok || value == "" {
		return "", &rejection{status: http.StatusUnauthorized, code: "principal_unresolved", detail: fmt.Sprintf("template %q did not resolve", h.Principal)}
	}
	if err := validatePrincipal(value); err != nil {
		return "", &rejection{status: http.StatusUnauthorized, code: "principal_unresolved", detail: err.Error()}
	}
	return value, nil
}

// validatePrincipal bounds a principal like a channel name (it becomes a
// key of the leases and throttles), but allows any printable character.
func validatePrincipal(p string) error {
	switch {
	case len(p) > MaxChannelNameLen:
		return fmt.Errorf("principal longer than %d bytes", MaxChannelNameLen)
	case !utf8.ValidString(p):
		return errors.New("principal is not valid UTF-8")
	case strings.ContainsFunc(p, unicode.IsControl):
		return errors.New("principal contains a control character")
	}
	return nil
}

// principalKey is a principal's name in the hub: namespaced like channels,
// since principals of different tenants may share ids.
func (h *Handler) principalKey(c client) string {
	if c.principal == "" {
		return ""
	}
	return h.channelKey(c.principal)
}

// clientIP is the client's address as Caddy sees it: the first untrusted
// address of X-Forwarded-For behind trusted proxies, else the peer.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// admission is what an admitted stream holds until it ends: its share of
// its principal's cap and its place in the instance's count.
type admission struct {
	census    *pubsub.Census
	principal string
	lease     pubsub.Lease
}

// release gives back what the stream held.
func (a *admission) release() {
	if a.lease != nil {
		a.lease.Release()
	}
	a.census.Leave(a.principal)
}

// releaseThen gives back what the stream held, and reports whether then
// will be called once the shared store no longer counts its lease (see
// pubsub.ReleaseNotifier); if not, nothing is left to wait for.
func (a *admission) releaseThen(then func()) bool {
	a.census.Leave(a.principal)
	if n, ok := a.lease.(pubsub.ReleaseNotifier); ok {
		n.ReleaseThen(then)
		return true
	}
	if a.lease != nil {
		a.lease.Release()
	}
	return false
}

// admit applies the checks that follow the channels (SPEC S2 steps 3 and
// 4): the throttle, the per-principal cap, then the instance cap. A refusal
// comes with its Retry-After. The shared stores fail open: a stream is
// not refused because a backend could not be asked (SPEC S9).
func (h *Handler) admit(ctx context.Context, c client) (*admission, *rejection, time.Duration) {
	if left := h.throttled(ctx, c); left > 0 {
		return nil, &rejection{status: http.StatusTooManyRequests, code: "throttled", detail: "this client was disconnected for reading too slowly"}, left
	}
	key := h.principalKey(c)
	a := &admission{census: h.hub.Census(), principal: key}
	if h.MaxConnections > 0 && a.census.Total() >= h.MaxConnections {
		return nil, h.refusalWhenFull(ctx, c, key), h.capRetryAfter()
	}
	if h.MaxConnectionsPerPrincipal > 0 {
		lease, err := h.hub.Leases().Acquire(ctx, key, h.MaxConnectionsPerPrincipal, time.Duration(h.LeaseTTL))
		switch {
		case errors.Is(err, pubsub.ErrLimitReached):
			return nil, h.tooManyConnections(), h.capRetryAfter()
		case err != nil:
			h.warnRarely(&h.warnings.capUnavailable, "connection cap unavailable; admitting the stream", zap.String("principal", c.principal), zap.Error(err))
		default:
			a.lease = lease
		}
	}
	if !a.census.Enter(key, h.MaxConnections) { // filled up since the check above
		if a.lease != nil {
			a.lease.Release()
		}
		return nil, serverFull, h.capRetryAfter()
	}
	return a, nil, 0
}

// serverFull is the refusal of a stream over the instance cap.
var serverFull = &rejection{status: http.StatusServiceUnavailable, code: "server_full", detail: "this server holds as many streams as it may"}

// tooManyConnections is the refusal of a stream over its principal's cap.
func (h *Handler) tooManyConnections() *rejection {
	return &rejection{status: http.StatusTooManyRequests, code: "too_many_connections", detail: perPrincipal(h.MaxConnectionsPerPrincipal)}
}

// refusalWhenFull is the refusal of a stream by a full instance: the
// principal's cap if it is reached (SPEC S2 checks it first), else the
// instance's. It counts the principal's streams without taking a lease: one
// taken only to be given back would count against the principal on every
// instance for that round trip, so a client hammering a full instance would
// have its principal's streams refused elsewhere. An unreachable count
// fails open to server_full.
func (h *Handler) refusalWhenFull(ctx context.Context, c client, key string) *rejection {
	if h.MaxConnectionsPerPrincipal <= 0 {
		return serverFull
	}
	held, err := h.hub.Leases().Held(ctx, key)
	if err != nil {
		h.warnRarely(&h.warnings.capUnavailableFull, "connection cap unavailable; refusing the stream for the instance cap", zap.String("principal", c.principal), zap.Error(err))
		return serverFull
	}
	if held >= h.MaxConnectionsPerPrincipal {
		return h.tooManyConnections()
	}
	return serverFull
}

// capRetryAfter is the Retry-After of a refusal for a cap.
func (h *Handler) capRetryAfter() time.Duration {
	return max(time.Duration(h.Retry), minCapRetryAfter)
}

// temporary reports whether a refusal may succeed later without a change of
// configuration or request: those are the ones in_stream answers in a 200.
func (r *rejection) temporary() bool {
	return r.status == http.StatusTooManyRequests || r.status == http.StatusServiceUnavailable
}

// inStream reports whether a refusal is answered inside a 200 stream.
func (h *Handler) inStream(r *http.Request, rej *rejection) bool {
	subscribing := r.Method == http.MethodGet || r.Method == http.MethodHead
	return h.Rejections == rejectionsInStream && subscribing && rej.temporary()
}

// rejectInStream answers a temporary refusal with a stream (SPEC S2): the
// stream's headers, "retry:" set to Retry-After, one sse_rejected event
// with the JSON body a status refusal would carry, and the end. A browser's
// EventSource then reconnects after that delay instead of giving up. A
// client that came with a cursor is given it back first, in an id-only
// block, so that it keeps it (appendClientID).
func rejectInStream(w http.ResponseWriter, r *http.Request, rej *rejection, retryAfter time.Duration) {
	data, _ := json.Marshal(errorBody{Error: rej.code, Detail: rej.detail})
	buf, _ := appendClientID(nil, lastEventID(r))
	buf = wire.AppendRetry(buf, wholeSeconds(retryAfter)*1000)
	writeShortStream(w, r, wire.AppendEnd(wire.AppendEvent(buf, wire.TypeRejected, data)))
}

// writeShortStream answers with a 200 stream of body alone, which ends
// there (a HEAD gets the headers).
func writeShortStream(w http.ResponseWriter, r *http.Request, body []byte) {
	setStreamHeaders(w.Header())
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	if _, err := w.Write(body); err == nil {
		_ = http.NewResponseController(w).Flush()
	}
}

// wholeSeconds rounds d up to whole seconds, as Retry-After gives it.
func wholeSeconds(d time.Duration) int64 {
	return int64((d + time.Second - 1) / time.Second)
}

// perPrincipal says the cap in a refusal's detail, in words a person reads
// ("at most 1 stream", not "1 streams").
func perPrincipal(limit int) string {
	if limit == 1 {
		return "at most 1 stream per principal"
	}
	return fmt.Sprintf("at most %d streams per principal", limit)
}
