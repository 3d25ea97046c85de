package caddysse

import (
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// ServeHTTP opens a stream on GET and HEAD, publishes on POST, and leaves
// OPTIONS to the next handler (CORS preflights).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		if len(h.Channels) == 0 {
			return h.methodNotAllowed(w, r)
		}
		return h.subscribe(w, r)
	case http.MethodPost:
		if h.Publish == nil {
			return h.methodNotAllowed(w, r)
		}
		h.publishing.begin()
		defer h.publishing.end()
		return h.publish(w, r)
	case http.MethodOptions:
		return next.ServeHTTP(w, r)
	default:
		return h.methodNotAllowed(w, r)
	}
}
