package caddysse

import (
	"crypto/rand"
	"encoding/base64"
	"net/http"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// A publish without an Idempotency-Key may fail after its call reached
// Redis: Redis ran it, and the answer was lost (Redis died or a failover
// cut the connection, or it stalled past go-redis' retries). The publisher
// gets 503 and cannot know whether the event went out; retrying it as is
// would publish it twice. So every such publish through a Redis hub
// carries a token derived from a key made up for it, and its 503 offers
// that key (idempotency_key): a retry with the same request under that
// Idempotency-Key carries the same token (onceToken), and Redis answers it
// with the first call's event for every channel that has one, as long as
// it keeps the token (at least 30 s). The embedded hub cannot fail after
// publishing, so its publishes need none.

// retryKeyPrefix marks the keys made up for a failed publish's retry.
const retryKeyPrefix = "sse-retry-"

// publishUnkeyed publishes a request that came without an Idempotency-Key.
func (h *Handler) publishUnkeyed(w http.ResponseWriter, r *http.Request, req *publishRequest) error {
	var tokens pubsub.Message
	retryKey := ""
	if h.hubKeepsTokens() {
		retryKey = newRetryKey()
		tokens.Token = onceToken(h.Namespace, retryKey, req.fingerprint())
	}
	reply, failure := h.publishAll(r.Context(), req, tokens)
	if failure != nil {
		failure.IdempotencyKey = retryKey
	}
	return h.answerPublish(w, r, reply, failure)
}

// hubKeepsTokens reports whether the hub's broker honours a publish's
// token (Redis).
func (h *Handler) hubKeepsTokens() bool {
	_, ok := h.hub.Broker().(*pubsub.Redis)
	return ok
}

// newRetryKey is a fresh key for the retry of one request: 128 random bits.
func newRetryKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return retryKeyPrefix + base64.RawURLEncoding.EncodeToString(b[:])
}
