package e2e

import (
	"fmt"
	"net/http"
	"net/url"
	"testing"
	"time"
)

// TestBrowserOversizeReconnectOverHTTP2: README "Streams of many
// channels". A reconnect past max_header_size over HTTP/2 is no 431 to
// Chromium: the request fails as a network error, which the EventSource
// retries for ever (never CLOSED), and each attempt cuts the other
// streams of the connection. Here cookies set after the stream opened
// (for the stream's path only) make its reconnect too large; another
// stream of the page, without them, is cut at every attempt.
func TestBrowserOversizeReconnectOverHTTP2(t *testing.T) {
	w := startBrowser(t, "--ignore-certificate-errors", "--disable-quic")
	dir := browserPageDir(t)
	p, port := startTLSCaddy(t, "", func(port int) string {
		return fmt.Sprintf(`https://localhost:%d {
	tls internal
	sse /events* {
		channel {query.channels}
		close_jitter 500ms
		retry 500ms
	}
	root * %s
	file_server
}
`, port, dir)
	})
	base := fmt.Sprintf("https://localhost:%d", port)
	headUntilServing(t, func() *http.Client { c, _ := tlsClient(t, port, true); return c }(), base+"/page.html").Body.Close()
	w.navigate(base + "/page.html?u=" + url.QueryEscape("/events/big?channels=a") + "&u=" + url.QueryEscape("/events?channels=b"))
	w.waitPage(time.Now().Add(waitFor), "both streams open", func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.K == "open" }) > 0 &&
			tagged(rs, "s1", func(r pageRecord) bool { return r.K == "open" }) > 0
	})
	// 20 KB of cookies on s0's path: its reconnect's header list is past
	// 16 KiB + 320, though each field is under it
	w.call("POST", "/session/"+w.sid+"/execute/sync", map[string]any{"script": `for (let i = 0; i < 5; i++) document.cookie = 'big' + i + '=' + 'x'.repeat(4000) + '; path=/events/big'`, "args": []any{}})
	p.reload()
	rs := w.waitPage(time.Now().Add(waitFor), "s0 retrying and s1 cut more than once", func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.K == "error" }) >= 3 &&
			tagged(rs, "s1", func(r pageRecord) bool { return r.K == "error" }) >= 3
	})
	if n := tagged(rs, "s0", func(r pageRecord) bool { return r.K == "open" }); n != 1 {
		t.Fatalf("s0 opened %d times, want once (its reconnect is too large); the page recorded:\n%s", n, formatRecords(rs))
	}
	for _, tag := range []string{"s0", "s1"} {
		if n := tagged(rs, tag, func(r pageRecord) bool { return r.K == "error" && r.RS == 2 }); n != 0 {
			t.Fatalf("%s was CLOSED (a final answer, as a 431 would be); the page recorded:\n%s", tag, formatRecords(rs))
		}
	}
}
