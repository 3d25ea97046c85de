package caddysse

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A refused stream's log line says whose it is: "request refused" had the
// code and the remote address but neither the principal nor the channels,
// so that an operator asked why user u1 is refused too_many_connections
// could not find its refusals in the log.
func TestRefusedStreamLogNamesItsPrincipalAndChannels(t *testing.T) {
	file := filepath.Join(t.TempDir(), "sse.log")
	logs := "log ssefile {\n\t\toutput file " + file + "\n\t\tformat json\n\t\tlevel DEBUG\n\t\tinclude http.handlers.sse\n\t}"
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		principal {query.u}
		max_connections_per_principal 1
	}
}
`, logs)
	srv.subscribe("/events?channels=a,b&u=u1", nil).comment("ok")
	resp := do(t, http.MethodGet, srv.base+"/events?channels=a,b&u=u1", nil, "")
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("second stream of u1: %d, want 429", resp.StatusCode)
	}
	var found bool
	eventually(t, "the refusal to be logged", func() bool {
		b, _ := os.ReadFile(file)
		for _, line := range strings.Split(string(b), "\n") {
			var entry struct {
				Msg       string   `json:"msg"`
				Code      string   `json:"code"`
				Principal string   `json:"principal"`
				Channels  []string `json:"channels"`
			}
			if json.Unmarshal([]byte(line), &entry) != nil || entry.Msg != "request refused" {
				continue
			}
			if entry.Code != "too_many_connections" || entry.Principal != "u1" || strings.Join(entry.Channels, ",") != "a,b" {
				t.Fatalf("refusal logged as %s", line)
			}
			found = true
		}
		return found
	})
}
