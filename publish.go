package caddysse

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// maxIdempotencyKeyLen bounds the Idempotency-Key header.
const maxIdempotencyKeyLen = 255

// publishReply is the body of a successful publish: the id of the event in
// each channel, usable as a Last-Event-ID.
type publishReply struct {
	IDs map[string]string `json:"ids"`
}

// publish serves a POST (SPEC S6): bearer secret, JSON or form body, one
// event published to each named channel, optionally once per
// Idempotency-Key.
func (h *Handler) publish(w http.ResponseWriter, r *http.Request) error {
	if !h.authorized(r) {
		return h.reject(w, r, &rejection{status: http.StatusUnauthorized, code: "unauthorized", detail: "missing or wrong bearer secret"}, 0)
	}
	req, rej := h.readPublish(w, r)
	if rej != nil {
		return h.reject(w, r, rej, 0)
	}
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		return h.publishUnkeyed(w, r, req)
	}
	if len(key) > maxIdempotencyKeyLen {
		return h.reject(w, r, &rejection{status: http.StatusBadRequest, code: "idempotency_key_invalid", detail: "Idempotency-Key is longer than 255 bytes"}, 0)
	}
	return h.publishOnce(w, r, key, req)
}

// publishOnce publishes unless the key was used before, in which case it
// returns the first reply (marked with Idempotent-Replayed: true).
func (h *Handler) publishOnce(w http.ResponseWriter, r *http.Request, key string, req *publishRequest) error {
	var failure *errorBody
	fingerprint := req.fingerprint()
	body, replayed, err := h.hub.Idempotency().Do(r.Context(), h.Namespace+"\x00"+key, fingerprint, func() ([]byte, error) {
		reply, f := h.publishAll(r.Context(), req, pubsub.Message{Once: onceToken(h.Namespace, key, fingerprint)})
		if f != nil {
			failure = f
			return nil, errors.New(f.Error)
		}
		return json.Marshal(reply)
	})
	switch {
	case errors.Is(err, pubsub.ErrKeyReused):
		return h.reject(w, r, &rejection{status: http.StatusUnprocessableEntity, code: "idempotency_key_reused", detail: "this Idempotency-Key was used with a different request"}, 0)
	case failure != nil:
		return h.answerPublish(w, r, nil, failure)
	case err != nil:
		return h.reject(w, r, &rejection{status: http.StatusServiceUnavailable, code: "publish_failed", detail: err.Error()}, time.Second)
	}
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	writeRawJSON(w, http.StatusOK, body)
	return nil
}

func writeRawJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	// body is shared by every retry of an Idempotency-Key: never append to it
	_, _ = w.Write(body)
	_, _ = w.Write([]byte{'\n'})
}

// authorized compares the bearer secret in constant time: their SHA-256
// digests, since comparing the secrets themselves would answer at once
// for a guess of another length, and so tell the secret's length.
func (h *Handler) authorized(r *http.Request) bool {
	auth := r.Header.Get("Authorization")
	const prefix = "Bearer "
	if len(auth) < len(prefix) || !strings.EqualFold(auth[:len(prefix)], prefix) {
		return false
	}
	given := sha256.Sum256([]byte(strings.TrimSpace(auth[len(prefix):])))
	return subtle.ConstantTimeCompare(given[:], h.secret) == 1
}

// publishAll publishes the event to every channel, one after the other,
// with the tokens (Once, Token) of tokens: a publish to several channels is
// not atomic across them, so a failure names the channels whose publish
// failed (and the ids of those that were published).
func (h *Handler) publishAll(ctx context.Context, req *publishRequest, tokens pubsub.Message) (*publishReply, *errorBody) {
	reply := &publishReply{IDs: make(map[string]string, len(req.channels))}
	msg := pubsub.Message{Type: req.event, Data: req.data, Once: tokens.Once, Token: tokens.Token,
		TokenRequired: len(req.channels) > 1}
	if h.Fallback == fallbackLocal {
		ctx = pubsub.WithFallbackLocal(ctx)
	}
	var failed []string
	var firstErr error
	for _, name := range req.channels {
		key := h.channelKey(name)
		pos, repeat, err := h.hub.PublishCounted(ctx, key, msg, h.limits)
		if err != nil {
			failed = append(failed, name)
			firstErr = cmpOr(firstErr, err)
			continue
		}
		if !repeat { // a keyed retry's channels published by its first attempt count once
			h.metrics.publishedEvent()
		}
		reply.IDs[name] = replay.EncodeCursor(replay.ChannelPosition{Hash: replay.HashChannel(key), Pos: pos})
	}
	if len(failed) > 0 {
		h.warnRarely(&h.warnings.publishFailed, "publish failed", zap.Strings("channels", failed), zap.Error(firstErr))
		return nil, &errorBody{Error: "publish_failed", Detail: firstErr.Error(), Channels: failed, IDs: reply.IDs}
	}
	return reply, nil
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func (h *Handler) answerPublish(w http.ResponseWriter, r *http.Request, reply *publishReply, failure *errorBody) error {
	if failure != nil {
		h.metrics.rejection(failure.Error) // logged by publishAll, with its channels
		w.Header().Set("Retry-After", "1")
		writeJSON(w, r, http.StatusServiceUnavailable, failure)
		return nil
	}
	writeJSON(w, r, http.StatusOK, reply)
	return nil
}

// onceToken is what makes a keyed request's publishes one per channel
// across its retries (pubsub.Message.Once): a retry after a failure on some
// channels publishes those, and gets the first ids of the others, which a
// fresh publish would have published a second time.
func onceToken(namespace, key, fingerprint string) string {
	sum := sha256.Sum256([]byte(namespace + "\x00" + key + "\x00" + fingerprint))
	return hex.EncodeToString(sum[:16])
}

// fingerprint identifies a publish request, to tell a retry (same request)
// from a reuse of its Idempotency-Key (another request).
func (req *publishRequest) fingerprint() string {
	sum := sha256.New()
	for _, c := range req.channels {
		sum.Write([]byte(c))
		sum.Write([]byte{0})
	}
	sum.Write([]byte{1})
	sum.Write([]byte(req.event))
	sum.Write([]byte{0})
	sum.Write(req.data)
	return hex.EncodeToString(sum.Sum(nil))
}
