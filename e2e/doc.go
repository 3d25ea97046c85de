// Package e2e holds end-to-end tests that run a caddy binary built from
// ./cmd/caddy (Caddy with its standard modules and the sse handler) and
// check what only a real process can show: that reloads and stops close
// the open streams, that `caddy reload` and `caddy stop` return, and that
// the process exits promptly with Caddy's default eternal grace period
// (SPEC S8).
//
// Run with: go test -race ./e2e/ -count=1 -v
//
// Set CADDY_SSE_E2E_RACE=1 to build the caddy binary itself with -race too
// (slower; a data race in the server then shows in its log and makes it
// exit with code 66). Set CADDY_SSE_E2E_LOG=1 to log caddy's output of
// passing tests too (it is always logged for failing ones).
//
// browser_test.go drives Chromium headless (chromium and chromedriver on
// PATH, or CADDY_SSE_CHROMIUM): without them it is skipped, and fails with
// CI=true.
package e2e
