package caddysse

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
)

// errorBody is the JSON body of every refusal: {"error": "<code>"}, with a
// human-readable detail where one helps a publisher fix its request, and the
// channels a failed publish did not reach.
type errorBody struct {
	Error    string            `json:"error"`
	Detail   string            `json:"detail,omitempty"`
	Channels []string          `json:"channels,omitempty"`
	IDs      map[string]string `json:"ids,omitempty"`
	// IdempotencyKey, on a failed publish sent without one, is the key
	// under which its retry publishes nothing twice (publish_retry.go).
	IdempotencyKey string `json:"idempotency_key,omitempty"`
}

// writeJSON writes a JSON response; a HEAD gets the same status and headers
// without the body.
func writeJSON(w http.ResponseWriter, r *http.Request, status int, body any) {
	payload, err := json.Marshal(body)
	if err != nil {
		payload = []byte(`{"error":"internal"}`)
		status = http.StatusInternalServerError
	}
	payload = append(payload, '\n')
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("Cache-Control", "no-store")
	hdr.Set("Content-Length", strconv.Itoa(len(payload)))
	w.WriteHeader(status)
	if r.Method != http.MethodHead {
		_, _ = w.Write(payload)
	}
}

// reject answers a refused request with its status and JSON body (or, for
// a temporary refusal of a stream with rejections in_stream, inside a 200
// stream), counts it and logs the reason at debug level (refusals can be
// frequent; they are not errors of the server), with who the request is
// from (fields: the principal and channels, once they are known).
func (h *Handler) reject(w http.ResponseWriter, r *http.Request, rej *rejection, retryAfter time.Duration, who ...zap.Field) error {
	if retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.FormatInt(wholeSeconds(retryAfter), 10))
	}
	if rej.status == http.StatusUnauthorized {
		// RFC 9110: a 401 carries a challenge. The module does not know how
		// a subscriber's principal is authenticated (a token, a cookie an
		// auth module reads); Bearer is the publish's, and no browser
		// prompts for it
		w.Header().Set("WWW-Authenticate", `Bearer realm="sse"`)
	}
	discardUnreadBody(w, r)
	inStream := h.inStream(r, rej)
	h.metrics.rejection(rej.code)
	if ce := h.logger.Check(zap.DebugLevel, "request refused"); ce != nil {
		ce.Write(append([]zap.Field{
			zap.String("code", rej.code),
			zap.Int("status", rej.status),
			zap.String("detail", rej.detail),
			zap.Bool("in_stream", inStream),
			zap.String("remote", r.RemoteAddr)}, who...)...)
	}
	if inStream {
		rejectInStream(w, r, rej, retryAfter)
		return nil
	}
	writeJSON(w, r, rej.status, errorBody{Error: rej.code, Detail: rej.detail})
	return nil
}

// discardUnreadBody reads what is left of a refused request's body (up to
// maxDrain, for at most drainWait) before the answer, as readPublish does
// for a body it refused: a request refused before its body is read (a wrong
// secret, a media type, a method) may still be sending it, and net/http
// reads at most 256 KiB of a body its handler left, then closes the
// connection with the rest unread, which resets it: the client, still
// writing, sees the reset instead of the refusal. Only HTTP/1.x needs it:
// HTTP/2 and HTTP/3 end the stream after the answer (RST_STREAM NO_ERROR,
// as RFC 9113 asks of a server that answers early), and reading a body
// trickled there held the handler as long as its client liked. Nor does a
// request that waits for 100 Continue: reading its body asked for it, and
// the client sent megabytes it had offered to keep. Its connection is
// closed after the answer instead, the body unsent (net/http would do so
// itself, but Caddy's wrapping of the body hides the request's wish from
// it, and it then waits to read a body that never comes).
func discardUnreadBody(w http.ResponseWriter, r *http.Request) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 || r.ProtoMajor != 1 {
		return
	}
	if strings.EqualFold(r.Header.Get("Expect"), "100-continue") {
		w.Header().Set("Connection", "close")
		return
	}
	drainRefused(w, r.Body)
}

// methodNotAllowed answers a method the route does not serve.
func (h *Handler) methodNotAllowed(w http.ResponseWriter, r *http.Request) error {
	w.Header().Set("Allow", h.allowedMethods())
	return h.reject(w, r, &rejection{status: http.StatusMethodNotAllowed, code: "method_not_allowed", detail: r.Method + " is not served here"}, 0)
}

func (h *Handler) allowedMethods() string {
	switch {
	case len(h.Channels) > 0 && h.Publish != nil:
		return "GET, HEAD, POST"
	case h.Publish != nil:
		return "POST"
	default:
		return "GET, HEAD"
	}
}
