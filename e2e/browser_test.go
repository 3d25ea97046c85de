package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The tests of this file drive a real browser, Chromium headless, through
// chromedriver's W3C WebDriver HTTP API (plain JSON over net/http: no
// dependency). Every other test reads streams with a Go client written to
// the WHATWG algorithm; these check the promise against the client it is
// made for: an EventSource that reconnects by itself after a 200 stream
// ends, with the last `retry:` and its Last-Event-ID, and gives up for good
// on anything else.
//
// Debian: apt-get install chromium chromium-driver (.ci/run does). With
// CI=true a missing browser fails the test; elsewhere it is skipped.

// browserPage is served next to the stream: it opens one EventSource per
// ?u= parameter and records every open, error and event (type, data,
// lastEventId) in window.got, which the test reads, and keeps each
// EventSource in window.sources under its tag (s0, s1, ...). With ?close, it does
// what README ("A page left keeps its stream") advises: it closes its
// EventSources on pagehide and, shown again from the back/forward cache,
// opens new ones with the last id each saw as lastEventID (recorded as
// k: 'reopen').
const browserPage = `<!doctype html>
<html><head><meta charset="utf-8"><title>sse browser test</title></head><body><script>
'use strict';
window.got = [];
window.sources = {};
const rec = (o) => { o.t = Math.round(performance.now()); window.got.push(o); };
const params = new URLSearchParams(location.search);
for (const [i, u] of params.getAll('u').entries()) {
  const tag = 's' + i;
  let es, last = '';
  const connect = () => {
    es = new EventSource(last ? u + (u.includes('?') ? '&' : '?') + 'lastEventID=' + encodeURIComponent(last) : u);
    window.sources[tag] = es;
    es.onopen = () => rec({k: 'open', tag, rs: es.readyState});
    es.onerror = () => rec({k: 'error', tag, rs: es.readyState});
    const ev = (e) => { if (e.lastEventId) last = e.lastEventId; rec({k: 'event', tag, type: e.type, data: e.data, id: e.lastEventId}); };
    es.onmessage = ev;
    for (const t of ['greet', 'server_closing', 'sse_truncated', 'sse_rejected', 'sse_degraded']) es.addEventListener(t, ev);
  };
  connect();
  if (params.has('close')) {
    addEventListener('pagehide', () => es.close());
    addEventListener('pageshow', (e) => { if (e.persisted) { rec({k: 'reopen', tag}); connect(); } });
  }
}
</script></body></html>
`

// browserPageDir returns a directory that serves browserPage as
// page.html.
func browserPageDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "page.html"), []byte(browserPage), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// pageRecord is one entry of window.got.
type pageRecord struct {
	K    string `json:"k"` // open, error, event
	Tag  string `json:"tag"`
	RS   int    `json:"rs"`
	Type string `json:"type"`
	Data string `json:"data"`
	ID   string `json:"id"`
	T    int    `json:"t"`
}

func (r pageRecord) String() string {
	if r.K != "event" {
		return fmt.Sprintf("%6d ms %s %s readyState=%d", r.T, r.Tag, r.K, r.RS)
	}
	return fmt.Sprintf("%6d ms %s %s %q id=%q", r.T, r.Tag, r.Type, r.Data, r.ID)
}

// findBrowser returns the paths of chromium and chromedriver, or fails
// (CI=true) or skips the test when either is missing.
func findBrowser(t *testing.T) (chromium, driver string) {
	t.Helper()
	chromium = os.Getenv("CADDY_SSE_CHROMIUM")
	if chromium == "" {
		for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
			if p, err := exec.LookPath(name); err == nil {
				chromium = p
				break
			}
		}
	}
	driver, _ = exec.LookPath("chromedriver")
	if chromium == "" || driver == "" {
		msg := "the browser tests need Chromium and chromedriver (Debian: apt-get install chromium chromium-driver; " +
			"or set CADDY_SSE_CHROMIUM to a Chrome binary and put its chromedriver on PATH)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return chromium, driver
}

// webDriver is a WebDriver session of one headless Chromium.
type webDriver struct {
	t      *testing.T
	base   string // chromedriver's URL
	sid    string
	client *http.Client
}

// startBrowser starts chromedriver on a free port and a headless Chromium
// session through it, with the extra command-line flags args; both end
// with the test (the session is deleted, which ends Chromium, then
// chromedriver is killed by its PID).
func startBrowser(t *testing.T, args ...string) *webDriver {
	t.Helper()
	chromium, driver := findBrowser(t)
	port := freePort(t, false)
	out := new(lockedBuffer)
	cmd := exec.Command(driver, fmt.Sprintf("--port=%d", port))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting chromedriver: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	w := &webDriver{t: t, base: fmt.Sprintf("http://127.0.0.1:%d", port), client: &http.Client{Timeout: 20 * time.Second}}
	t.Cleanup(func() {
		if w.sid != "" {
			_, _ = w.try(http.MethodDelete, "/session/"+w.sid, nil)
		}
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("chromedriver output:\n%s", out.String())
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := w.try(http.MethodGet, "/status", nil); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("chromedriver did not answer within 10s: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	v := w.call(http.MethodPost, "/session", map[string]any{"capabilities": map[string]any{"alwaysMatch": map[string]any{
		"browserName": "chrome",
		"goog:chromeOptions": map[string]any{
			"binary": chromium,
			// --no-sandbox: CI containers run as root, where Chromium's sandbox cannot start
			"args": append([]string{"--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"}, args...),
		},
	}}})
	var s struct {
		SessionID string `json:"sessionId"`
	}
	if err := json.Unmarshal(v, &s); err != nil || s.SessionID == "" {
		t.Fatalf("new WebDriver session: %s (%v)", v, err)
	}
	w.sid = s.SessionID
	return w
}

// try sends one WebDriver command and returns its value.
func (w *webDriver) try(method, path string, body any) (json.RawMessage, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, w.base+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := w.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var reply struct {
		Value json.RawMessage `json:"value"`
	}
	if err := json.Unmarshal(raw, &reply); err != nil {
		return nil, fmt.Errorf("%s %s: status %d: %.300s", method, path, resp.StatusCode, raw)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s %s: status %d: %.500s", method, path, resp.StatusCode, reply.Value)
	}
	return reply.Value, nil
}

func (w *webDriver) call(method, path string, body any) json.RawMessage {
	w.t.Helper()
	v, err := w.try(method, path, body)
	if err != nil {
		w.t.Fatalf("WebDriver: %v", err)
	}
	return v
}

func (w *webDriver) navigate(u string) {
	w.t.Helper()
	w.call(http.MethodPost, "/session/"+w.sid+"/url", map[string]any{"url": u})
}

// records returns what the page recorded so far.
func (w *webDriver) records() []pageRecord {
	w.t.Helper()
	v := w.call(http.MethodPost, "/session/"+w.sid+"/execute/sync", map[string]any{"script": "return window.got || []", "args": []any{}})
	var rs []pageRecord
	if err := json.Unmarshal(v, &rs); err != nil {
		w.t.Fatalf("reading the page's records %.300s: %v", v, err)
	}
	return rs
}

// waitPage polls the page's records until done holds, at the latest until
// deadline; then it fails the test with everything the page recorded.
func (w *webDriver) waitPage(deadline time.Time, what string, done func([]pageRecord) bool) []pageRecord {
	w.t.Helper()
	for {
		rs := w.records()
		if done(rs) {
			return rs
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("the page did not get %s in time; it recorded:\n%s", what, formatRecords(rs))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func formatRecords(rs []pageRecord) string {
	var b strings.Builder
	for _, r := range rs {
		b.WriteString(r.String())
		b.WriteByte('\n')
	}
	return b.String()
}

// tagged is how many of rs are of source tag and match f.
func tagged(rs []pageRecord, tag string, f func(pageRecord) bool) int {
	n := 0
	for _, r := range rs {
		if r.Tag == tag && f(r) {
			n++
		}
	}
	return n
}

// publishEvent publishes a form (event type optional) and fails the test on
// anything but 200.
func publishEvent(t *testing.T, client *http.Client, publishURL, channel, event, data string) {
	t.Helper()
	form := url.Values{"channel": {channel}, "data": {data}}
	if event != "" {
		form.Set("event", event)
	}
	req, _ := http.NewRequest(http.MethodPost, publishURL, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer "+testSecret)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("publishing %q to %q: %v", data, channel, err)
	}
	reply, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("publishing %q to %q: %d %s", data, channel, resp.StatusCode, reply)
	}
}

// browserSite serves the page from dir and an sse route whose accesses are
// logged (with their request headers) to accessLog.
func browserSite(adminPort, port int, dir, accessLog, extra string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
}

http://127.0.0.1:%d {
	log {
		output file %s
		format json
	}
	sse /events {
		channel {query.channels}
		close_jitter 1s
		publish {
			secret %s
		}
		%s
	}
	root * %s
	file_server
}
`, adminPort, port, accessLog, testSecret, extra, dir)
}

// pageSite is a caddy binary serving the test page from a directory and
// an sse route (browserSite).
type pageSite struct {
	proc      *caddyProc
	base      string                    // the site's URL
	accessLog string                    // the route's access log
	caddyfile func(extra string) string // the site's config, extra in its sse block (for a reload or a restart)
}

// startBrowserSite starts a caddy binary on browserSite, serving dir, with
// extra directives in its sse block.
func startBrowserSite(t *testing.T, dir, extra string) *pageSite {
	t.Helper()
	accessLog := filepath.Join(t.TempDir(), "access.log")
	adminPort, port := freePort(t, false), freePort(t, false)
	caddyfile := func(extra string) string { return browserSite(adminPort, port, dir, accessLog, extra) }
	return &pageSite{
		proc:      startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), caddyfile(extra)),
		base:      fmt.Sprintf("http://127.0.0.1:%d", port),
		accessLog: accessLog,
		caddyfile: caddyfile,
	}
}

// pageURL is the test page opening one EventSource per stream URI.
func pageURL(base string, streams ...string) string {
	q := url.Values{"u": streams}
	return base + "/page.html?" + q.Encode()
}

// streamRequests returns the Last-Event-ID header of every stream request
// of the access log whose URI is uri, in the order they ended.
func streamRequests(t *testing.T, accessLog, uri string) []string {
	t.Helper()
	var ids []string
	for _, a := range streamAccesses(t, accessLog, uri) {
		ids = append(ids, a.lastEventID)
	}
	return ids
}

// streamAccess is one stream request of the access log.
type streamAccess struct {
	lastEventID string
	status      int
}

// streamAccesses returns every GET of the access log whose URI is uri, in
// the order they ended.
func streamAccesses(t *testing.T, accessLog, uri string) []streamAccess {
	t.Helper()
	f, err := os.Open(accessLog)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []streamAccess
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var entry struct {
			Request struct {
				Method  string              `json:"method"`
				URI     string              `json:"uri"`
				Headers map[string][]string `json:"headers"`
			} `json:"request"`
			Status int `json:"status"`
		}
		if json.Unmarshal(sc.Bytes(), &entry) != nil || entry.Request.Method != http.MethodGet || entry.Request.URI != uri {
			continue
		}
		out = append(out, streamAccess{strings.Join(entry.Request.Headers["Last-Event-Id"], ","), entry.Status})
	}
	return out
}

// TestBrowserEventSourceThroughReloadAndRestart: Chromium's EventSource
// against a caddy binary.
//   - A page's EventSources receive what is published: onmessage and a
//     named type, multi-line data (CR, LF, CRLF) as one data with LF, JSON.
//   - `caddy reload` while events are published every few milliseconds:
//     each EventSource gets server_closing, reconnects by itself (its
//     readyState stays CONNECTING, never CLOSED), and has every event
//     exactly once, in order.
//   - A stream that got no event yet is given an id by the module's
//     id-only block (S8, README "Reload and stop"): the browser takes it
//     (server_closing's lastEventId), sends it back as Last-Event-ID, and
//     gets the event published while it was away.
//   - `caddy stop` and a new process (the embedded hub's history is gone):
//     the EventSources come back by themselves once the server answers, and
//     are told sse_truncated, not left to miss events silently.
func TestBrowserEventSourceThroughReloadAndRestart(t *testing.T) {
	w := startBrowser(t)
	site := startBrowserSite(t, browserPageDir(t), "")
	p, base, accessLog := site.proc, site.base, site.accessLog
	publishURL := base + "/events"
	pub := h1Client(t, false)

	// s0: news; s1: news and alerts (a cursor of two channels); s2: quiet,
	// which gets no event before the reload
	w.navigate(pageURL(base, "/events?channels=news", "/events?channels=news,alerts", "/events?channels=quiet"))
	tags := []string{"s0", "s1", "s2"}
	opened := func(n int) func([]pageRecord) bool {
		return func(rs []pageRecord) bool {
			for _, tag := range tags {
				if tagged(rs, tag, func(r pageRecord) bool { return r.K == "open" }) < n {
					return false
				}
			}
			return true
		}
	}
	w.waitPage(time.Now().Add(waitFor), "every EventSource open", opened(1))

	// delivery: what the page's listeners see
	publishEvent(t, pub, publishURL, "news", "", "plain")
	publishEvent(t, pub, publishURL, "news", "greet", "named")
	publishEvent(t, pub, publishURL, "news", "", "l1\nl2\r\nl3\rl4")
	publishEvent(t, pub, publishURL, "news", "", `{"n":[1,2],"s":"é"}`)
	want := []pageRecord{
		{Type: "message", Data: "plain"},
		{Type: "greet", Data: "named"},
		{Type: "message", Data: "l1\nl2\nl3\nl4"},
		{Type: "message", Data: `{"n":[1,2],"s":"é"}`},
	}
	events := func(rs []pageRecord, tag string) []pageRecord {
		var out []pageRecord
		for _, r := range rs {
			if r.Tag == tag && r.K == "event" {
				out = append(out, r)
			}
		}
		return out
	}
	rs := w.waitPage(time.Now().Add(waitFor), "the four events", func(rs []pageRecord) bool {
		return len(events(rs, "s0")) >= len(want) && len(events(rs, "s1")) >= len(want)
	})
	for _, tag := range tags[:2] {
		got := events(rs, tag)
		for i, e := range want {
			if got[i].Type != e.Type || got[i].Data != e.Data || got[i].ID == "" {
				t.Fatalf("%s: event %d is %v, want type %q data %q with an id; the page recorded:\n%s",
					tag, i, got[i], e.Type, e.Data, formatRecords(rs))
			}
		}
	}

	// reload while a publisher numbers events on news
	var (
		stop      atomic.Bool
		published atomic.Int64
		pubErr    atomic.Value
		wg        sync.WaitGroup
	)
	wg.Go(func() {
		for n := int64(1); !stop.Load(); n++ {
			form := url.Values{"channel": {"news"}, "data": {fmt.Sprint(n)}}
			for attempt := 0; ; attempt++ {
				req, _ := http.NewRequest(http.MethodPost, publishURL, strings.NewReader(form.Encode()))
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				req.Header.Set("Authorization", "Bearer "+testSecret)
				// no Idempotency-Key: the embedded hub answers or not, and a
				// connection reset at the reload (README: about 1 in 40
				// publishes sent at that moment) was not read, so it is sent
				// again
				resp, err := pub.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						break
					}
					err = fmt.Errorf("status %d", resp.StatusCode)
				}
				if attempt == 20 {
					pubErr.Store(fmt.Errorf("publishing %d: %v", n, err))
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			published.Store(n)
			time.Sleep(5 * time.Millisecond)
		}
	})
	defer func() { stop.Store(true); wg.Wait() }()
	w.waitPage(time.Now().Add(waitFor), "numbered events before the reload", func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.Data == "20" }) > 0
	})
	p.writeConfig(site.caddyfile("retry 2s"))
	p.reload()
	publishEvent(t, pub, publishURL, "quiet", "", "while away")
	w.waitPage(time.Now().Add(waitFor), "every EventSource reopened after server_closing", opened(2))
	// the reopened streams take live events, then the publisher stops
	after := published.Load() + 20
	w.waitPage(time.Now().Add(waitFor), "live events after the reload", func(rs []pageRecord) bool {
		return tagged(rs, "s1", func(r pageRecord) bool { return r.Data == fmt.Sprint(after) }) > 0
	})
	stop.Store(true)
	wg.Wait()
	if err, _ := pubErr.Load().(error); err != nil {
		t.Fatal(err)
	}
	last := fmt.Sprint(published.Load())
	rs = w.waitPage(time.Now().Add(waitFor), "the last numbered event "+last, func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.Data == last }) > 0 &&
			tagged(rs, "s1", func(r pageRecord) bool { return r.Data == last }) > 0
	})
	for _, tag := range tags[:2] {
		next := int64(1)
		for _, r := range events(rs, tag) {
			var n int64
			if r.Type != "message" || r.ID == "" {
				continue
			}
			if _, err := fmt.Sscan(r.Data, &n); err != nil || r.Data != fmt.Sprint(n) {
				continue // the delivery checks' events
			}
			if n != next {
				t.Fatalf("%s: got n=%d where n=%d was due (a gap or a duplicate across the reload); the page recorded:\n%s",
					tag, n, next, formatRecords(rs))
			}
			next++
		}
		if fmt.Sprint(next-1) != last {
			t.Fatalf("%s: got n up to %d, want %s", tag, next-1, last)
		}
	}
	for _, tag := range tags {
		if n := tagged(rs, tag, func(r pageRecord) bool { return r.Type == "server_closing" && r.Data == `{"reason":"reload"}` }); n != 1 {
			t.Fatalf("%s: %d server_closing with reason reload, want 1; the page recorded:\n%s", tag, n, formatRecords(rs))
		}
		if n := tagged(rs, tag, func(r pageRecord) bool { return r.K == "error" && r.RS == 2 }); n != 0 {
			t.Fatalf("%s: the EventSource was CLOSED (gave up); the page recorded:\n%s", tag, formatRecords(rs))
		}
	}
	// s2 had no event: the id it reconnects with is the id-only block's
	var quietID string
	for _, r := range rs {
		if r.Tag == "s2" && r.Type == "server_closing" {
			quietID = r.ID
		}
	}
	if quietID == "" {
		t.Fatalf("s2 (no event yet) got server_closing without a lastEventId: the browser has no id to come back with; the page recorded:\n%s", formatRecords(rs))
	}
	w.waitPage(time.Now().Add(waitFor), "the event published on quiet while s2 was away", func(rs []pageRecord) bool {
		return tagged(rs, "s2", func(r pageRecord) bool { return r.Data == "while away" }) == 1
	})

	// caddy stop, and a new process on the same ports: its embedded hub
	// starts a new history
	stopAt := time.Now()
	p.stopCLI()
	p.waitExit(time.Now().Add(waitFor), stopAt)
	// the log is complete: every stream so far has ended
	if ids := streamRequests(t, accessLog, "/events?channels=quiet"); len(ids) != 2 || ids[0] != "" || ids[1] != quietID {
		t.Fatalf("requests of s2 carried Last-Event-ID %q, want none and then %q (the id-only block's)", ids, quietID)
	}
	rs = w.records()
	for _, tag := range tags {
		if n := tagged(rs, tag, func(r pageRecord) bool { return r.Type == "server_closing" && r.Data == `{"reason":"shutdown"}` }); n != 1 {
			t.Fatalf("%s: %d server_closing with reason shutdown, want 1; the page recorded:\n%s", tag, n, formatRecords(rs))
		}
	}
	startCaddy(t, p.adminAddr, site.caddyfile(""))
	rs = w.waitPage(time.Now().Add(waitFor), "every EventSource back and told sse_truncated", func(rs []pageRecord) bool {
		for _, tag := range tags {
			if tagged(rs, tag, func(r pageRecord) bool { return r.Type == "sse_truncated" }) != 1 {
				return false
			}
		}
		return true
	})
	// every channel that had events is named (alerts, which never had one,
	// is left to the replay tests)
	for _, c := range []struct{ tag, channel string }{{"s0", "news"}, {"s1", "news"}, {"s2", "quiet"}} {
		for _, r := range rs {
			if r.Tag != c.tag || r.Type != "sse_truncated" {
				continue
			}
			var v struct {
				Channels []string `json:"channels"`
			}
			if err := json.Unmarshal([]byte(r.Data), &v); err != nil || !slices.Contains(v.Channels, c.channel) {
				t.Errorf("%s: sse_truncated %q, want it to name %q", c.tag, r.Data, c.channel)
			}
		}
	}
	publishEvent(t, pub, publishURL, "news", "", "after restart")
	publishEvent(t, pub, publishURL, "quiet", "", "after restart")
	w.waitPage(time.Now().Add(waitFor), "live events after the restart", func(rs []pageRecord) bool {
		for _, tag := range tags {
			if tagged(rs, tag, func(r pageRecord) bool { return r.Data == "after restart" }) != 1 {
				return false
			}
		}
		return true
	})
}
