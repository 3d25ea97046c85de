package caddysse

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// sseLog is a global option that sends the module's logs to file.
func sseLog(file string) string {
	return "log ssefile {\n\t\toutput file " + file + "\n\t\tformat json\n\t\tinclude http.handlers.sse\n\t}"
}

// The Redis hub outlives the config that made it, and so must not keep its
// logger: after a reload that changes where (or at which level) the
// module logs, the hub logs there too. It kept the first config's logger,
// whose output Caddy had let go with that config: "redis is unreachable"
// went on to the old file, which the running config no longer names.
func TestRedisHubLogsWhereTheRunningConfigSays(t *testing.T) {
	rds := redistest.Start(t)
	dir := t.TempDir()
	first, second := filepath.Join(dir, "first.log"), filepath.Join(dir, "second.log")
	site := redisSite(rds.URL())
	srv := startCaddy(t, site, sseLog(first))
	c := srv.subscribe("/events?channels=a", nil)
	c.comment("ok")
	srv.reload(site, sseLog(second))
	openCountedStream(t, srv, rds, "a", nil)
	rds.Kill()
	eventually(t, "the running config's log to say redis is unreachable", func() bool {
		b, _ := os.ReadFile(second)
		return strings.Contains(string(b), "redis is unreachable")
	})
}
