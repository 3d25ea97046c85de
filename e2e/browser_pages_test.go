package e2e

import (
	"net/url"
	"testing"
	"time"
)

// TestBrowserPageLeftKeepsItsStream: README "A page left keeps its
// stream". Chromium keeps a page the user navigated away from in its
// back/forward cache with its EventSource open, so the page's stream
// still counts against its principal's cap when the next page opens its
// own; a page that closes its EventSource on pagehide frees it, and shown
// again (Back) resumes from the last id it saw, with lastEventID.
func TestBrowserPageLeftKeepsItsStream(t *testing.T) {
	w := startBrowser(t)
	// in_stream: a refused page retries, so that the test does not hang on
	// which of a closed stream and a new one the server sees first
	base := startBrowserSite(t, browserPageDir(t),
		"principal {query.user}\n\t\tmax_connections_per_principal 1\n\t\trejections in_stream").base
	pub := h1Client(t, false)
	page := func(query, stream string) string {
		return base + "/page.html?" + query + "&u=" + url.QueryEscape(stream)
	}
	opened := func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.K == "open" }) > 0
	}
	got := func(data string) func([]pageRecord) bool {
		return func(rs []pageRecord) bool {
			return tagged(rs, "s0", func(r pageRecord) bool { return r.Data == data }) > 0
		}
	}

	// a page that does nothing on pagehide: the next one is refused
	w.navigate(page("p=1", "/events?channels=a&user=u"))
	w.waitPage(time.Now().Add(waitFor), "the first page's stream", opened)
	w.navigate(page("p=2", "/events?channels=b&user=u"))
	rs := w.waitPage(time.Now().Add(waitFor), "sse_rejected (the page left holds the principal's stream)", func(rs []pageRecord) bool {
		return tagged(rs, "s0", func(r pageRecord) bool { return r.Type == "sse_rejected" }) > 0
	})
	if tagged(rs, "s0", func(r pageRecord) bool {
		return r.Type == "sse_rejected" && r.Data == `{"error":"too_many_connections","detail":"at most 1 stream per principal"}`
	}) == 0 {
		t.Fatalf("the second page was refused otherwise than for its principal's cap:\n%s", formatRecords(rs))
	}

	// pages that close their EventSource on pagehide
	w.navigate(page("close&p=3", "/events?channels=a&user=v"))
	w.waitPage(time.Now().Add(waitFor), "the third page's stream", opened)
	publishEvent(t, pub, base+"/events", "a", "", "to a") // the page's last id, to resume from
	w.waitPage(time.Now().Add(waitFor), "an event on the third page", got("to a"))
	w.navigate(page("close&p=4", "/events?channels=b&user=v"))
	w.waitPage(time.Now().Add(waitFor), "the fourth page's stream", opened)
	publishEvent(t, pub, base+"/events", "b", "", "to b")
	w.waitPage(time.Now().Add(waitFor), "an event on the fourth page (the third page's stream was freed)", got("to b"))
	publishEvent(t, pub, base+"/events", "a", "", "while away")
	w.call("POST", "/session/"+w.sid+"/back", map[string]any{})
	rs = w.waitPage(time.Now().Add(waitFor), "the event published while the third page was left", got("while away"))
	if tagged(rs, "s0", func(r pageRecord) bool { return r.K == "reopen" }) != 1 {
		t.Fatalf("the third page was not shown again from the back/forward cache:\n%s", formatRecords(rs))
	}
}
