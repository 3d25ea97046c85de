// Command caddy is Caddy with its standard modules and the sse handler, so
// that `go run ./cmd/caddy run --config Caddyfile.example` works without
// xcaddy.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-sse/caddy-sse"
)

func main() {
	caddycmd.Main()
}
