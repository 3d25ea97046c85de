package caddysse

import "net/http"

// An HTTP/2 or HTTP/3 stream keeps its handler goroutine for its whole
// life: the server ends the stream when the handler returns, and neither
// lets a handler hand a stream over; so does an HTTP/1.1 stream that no
// event loop takes over (the net_http writer). That goroutine parks inside
// Caddy's handler chain with about 6 KiB of its stack in use, so it fits in
// 8 KiB; but the stream's work below it — resolving templates, Redis calls,
// writing through Caddy's writers and net/http's or net/http2's — goes past
// 8 KiB at some point, and the runtime then doubles the stack to 16 KiB and
// keeps it (it shrinks a stack only when a quarter of it is in use). So that
// work runs on other goroutines: the stream's start on a step pool
// (steps.go), its writes on the drainer's (drainer.go); the handler
// goroutine waits. An idle HTTP/2 stream's stacks: 16.1 → 8.5 KiB; an
// HTTP/1.1 stream's (with net/http's reading goroutine) 18.0 → 10.0 KiB.

// keepsHandlerGoroutine tells whether a stream of r keeps its handler
// goroutine for its whole life: HTTP/2 and HTTP/3 whatever the writer, and
// every stream without the takeover writer's loops. (An HTTP/1.x stream the
// loops refuse after its headers — HTTP/1.0, an identity response — keeps
// it too, on a stack its start may have grown: too rare to decide on
// before.)
func (h *Handler) keepsHandlerGoroutine(r *http.Request) bool {
	return r.ProtoMajor >= 2 || h.loops == nil
}

// onOwnStack runs f on a goroutine of the step pool if own (the stream's
// handler goroutine stays with it: keepsHandlerGoroutine), and waits for
// it. A panic in f is raised again on the calling goroutine, where
// net/http recovers it as it would have.
func (h *Handler) onOwnStack(own bool, f func()) {
	if !own {
		f()
		return
	}
	h.steps.run(f)
}
