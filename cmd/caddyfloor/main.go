// Command caddyfloor is Caddy with its standard modules and one more
// handler, sse_floor, for the connection-ramp benchmarks of
// docs/PERFORMANCE.md: it answers a GET with the headers and the opening
// comment of an SSE stream, as the sse handler does, then takes the
// connection over and only keeps it (no channel, no events, no close
// detection). What a connection costs it is what Caddy and net/http cost
// before and around any stream handler: the floor of the sse handler's
// connection ramp inside Caddy. Not for use outside benchmarks.
package main

import (
	"io"
	"net/http"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func init() {
	caddy.RegisterModule(Floor{})
	httpcaddyfile.RegisterHandlerDirective("sse_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		var f Floor
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
}

func main() {
	caddycmd.Main()
}

// Floor is the sse_floor handler.
type Floor struct{}

// CaddyModule returns the Caddy module information.
func (Floor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.sse_floor", New: func() caddy.Module { return new(Floor) }}
}

// UnmarshalCaddyfile takes the directive, which has no arguments.
func (Floor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	for d.Next() {
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// held keeps the connections taken over, so that they stay open.
var held sync.Map

// ServeHTTP writes a stream's headers and opening comment, then takes
// the connection over and keeps it.
func (Floor) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store, no-transform")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	if _, err := io.WriteString(w, ": ok\nretry: 3000\n\n"); err != nil {
		return err
	}
	if err := rc.Flush(); err != nil {
		return err
	}
	conn, _, err := rc.Hijack()
	if err != nil {
		return err
	}
	held.Store(conn, struct{}{})
	return nil
}

var (
	_ caddyhttp.MiddlewareHandler = Floor{}
	_ caddyfile.Unmarshaler       = Floor{}
)
