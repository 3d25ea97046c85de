package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// script runs JavaScript in the page and returns its result.
func (w *webDriver) script(js string, args ...any) json.RawMessage {
	w.t.Helper()
	if args == nil {
		args = []any{}
	}
	return w.call(http.MethodPost, "/session/"+w.sid+"/execute/sync", map[string]any{"script": js, "args": args})
}

// demoRows returns the demo page's log, oldest first, as "type data" texts.
func demoRows(w *webDriver) []string {
	w.t.Helper()
	var rows []string
	v := w.script(`return Array.from(document.querySelectorAll('#log tr')).reverse().map(r => r.cells[1].textContent + ' ' + r.cells[2].textContent)`)
	if err := json.Unmarshal(v, &rows); err != nil {
		w.t.Fatalf("reading the demo's log %.300s: %v", v, err)
	}
	return rows
}

func waitRows(w *webDriver, deadline time.Time, what string, done func([]string) bool) []string {
	w.t.Helper()
	for {
		rows := demoRows(w)
		if done(rows) {
			return rows
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("the demo page did not show %s in time; its log:\n%s", what, strings.Join(rows, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func countRows(rows []string, prefix string) int {
	n := 0
	for _, r := range rows {
		if strings.HasPrefix(r, prefix) {
			n++
		}
	}
	return n
}

// TestBrowserDemoResumesAfterARestart: the README's demo in Chromium. The
// page connects and publishes from its form; after Caddy is stopped and
// started again (the embedded hub's history is gone) it is told
// sse_truncated once; a Disconnect and a Connect that resumes from the last
// id then are not truncated again: the page resumes from the stream's new
// position (the lastEventId of the module's notices), not from the id of
// its last event before the restart, which the new history does not have.
func TestBrowserDemoResumesAfterARestart(t *testing.T) {
	w := startBrowser(t)
	ex := startExample(t)
	p, secret := ex.proc, ex.secret
	w.navigate(fmt.Sprintf("http://127.0.0.1:%d/", ex.port))
	w.script(`document.getElementById('pub-secret').value = arguments[0]`, secret)

	state := func() string {
		var s string
		_ = json.Unmarshal(w.script(`return document.getElementById('state').textContent`), &s)
		return s
	}
	click := func(id string) { w.script(`document.getElementById(arguments[0]).click()`, id) }
	publishFromPage := func(data string) {
		w.script(`document.getElementById('pub-data').value = arguments[0]; document.querySelector('#pub-form button[type=submit]').click()`, data)
	}

	click("connect")
	waitRows(w, time.Now().Add(waitFor), "the stream open", func([]string) bool { return state() == "open" })
	publishFromPage("before")
	waitRows(w, time.Now().Add(waitFor), "the event published from the page", func(rows []string) bool {
		return countRows(rows, "greet before") == 1
	})

	stopAt := time.Now()
	p.stopCLI()
	p.waitExit(time.Now().Add(waitFor), stopAt)
	ex.start(t)
	waitRows(w, time.Now().Add(waitFor), "sse_truncated after the restart", func(rows []string) bool {
		return countRows(rows, "sse_truncated") == 1 && state() == "open"
	})

	click("connect") // Disconnect
	click("connect") // Connect, resuming from the last id
	waitRows(w, time.Now().Add(waitFor), "the stream open again", func([]string) bool { return state() == "open" })
	publishFromPage("after")
	rows := waitRows(w, time.Now().Add(waitFor), "the event published after the resume", func(rows []string) bool {
		return countRows(rows, "greet after") == 1
	})
	if n := countRows(rows, "sse_truncated"); n != 1 {
		t.Fatalf("the page was told sse_truncated %d times, want once (at the restart): its Connect resumed from an id "+
			"the new history does not have; its log:\n%s", n, strings.Join(rows, "\n"))
	}
}
