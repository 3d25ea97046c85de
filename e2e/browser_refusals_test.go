package e2e

import (
	"net/http"
	"testing"
	"time"
)

// TestBrowserRefusalsDoWhatTheStatusTableSays: the last column of README's
// status table ("what a browser's EventSource does"), checked in Chromium.
//   - `rejections status` (the default): a 401 (no principal), a 400 (an
//     invalid channel), a 403 (an unresolved channel) and a 429 (the
//     principal holds its one stream) each fail the EventSource for good:
//     an error with readyState CLOSED, one request, never open.
//   - `rejections in_stream`: the refused EventSource opens (the refusal is
//     a 200 stream), gets sse_rejected, is left CONNECTING when the stream
//     ends, and reconnects by itself after the refusal's `retry:` (5 s,
//     longer than Chromium's own 3 s); once the principal's other stream is
//     closed it opens and takes events.
func TestBrowserRefusalsDoWhatTheStatusTableSays(t *testing.T) {
	w := startBrowser(t)
	dir := browserPageDir(t)
	const capped = "principal {query.user}\n\t\tmax_connections_per_principal 1"
	refusedForGood(t, w, dir, capped)
	refusedInTheStream(t, w, dir, capped+"\n\t\trejections in_stream")
}

// refusedForGood: with `rejections status`, each refusal fails its
// EventSource for good.
func refusedForGood(t *testing.T, w *webDriver, dir, site string) {
	s := startBrowserSite(t, dir, site)
	base, accessLog := s.base, s.accessLog
	uris := map[string]string{
		// s0 and s1 are the same principal's: whichever the server takes
		// first opens, the other is refused with 429
		"s0": "/events?channels=a&user=u",
		"s1": "/events?channels=b&user=u",
		"s2": "/events?channels=a",           // no principal: 401
		"s3": "/events?channels=%7Bx&user=v", // "{x": 400
		"s4": "/events?user=z",               // no channel: 403
	}
	statuses := map[string]int{"s2": http.StatusUnauthorized, "s3": http.StatusBadRequest, "s4": http.StatusForbidden}
	w.navigate(pageURL(base, uris["s0"], uris["s1"], uris["s2"], uris["s3"], uris["s4"]))
	closed := func(r pageRecord) bool { return r.K == "error" && r.RS == 2 }
	opened := func(r pageRecord) bool { return r.K == "open" }
	rs := w.waitPage(time.Now().Add(waitFor), "one of s0, s1 open and every other EventSource closed", func(rs []pageRecord) bool {
		if tagged(rs, "s0", opened)+tagged(rs, "s1", opened) == 0 || tagged(rs, "s0", closed)+tagged(rs, "s1", closed) == 0 {
			return false
		}
		for tag := range statuses {
			if tagged(rs, tag, closed) == 0 {
				return false
			}
		}
		return true
	})
	if tagged(rs, "s0", opened) > 0 {
		statuses["s1"] = http.StatusTooManyRequests
	} else {
		statuses["s0"] = http.StatusTooManyRequests
	}
	for tag, status := range statuses {
		if tagged(rs, tag, opened) != 0 || tagged(rs, tag, closed) != 1 {
			t.Errorf("%s (%d) did not fail once for good without opening; the page recorded:\n%s", tag, status, formatRecords(rs))
		}
		if got := streamAccesses(t, accessLog, uris[tag]); len(got) != 1 || got[0].status != status {
			t.Errorf("%s: the access log has %+v for %s, want one request answered %d", tag, got, uris[tag], status)
		}
	}
}

// refusedInTheStream: with `rejections in_stream`, a refused EventSource
// reconnects by itself after the refusal's retry, and opens once the
// principal's other stream is gone.
func refusedInTheStream(t *testing.T, w *webDriver, dir, site string) {
	base := startBrowserSite(t, dir, site).base
	w.navigate(pageURL(base, "/events?channels=a&user=u", "/events?channels=b&user=u"))
	rejected := func(r pageRecord) bool { return r.Type == "sse_rejected" }
	ended := func(r pageRecord) bool { return r.K == "error" }
	rs := w.waitPage(time.Now().Add(waitFor), "one of s0, s1 refused in its stream, and the stream ended", func(rs []pageRecord) bool {
		return tagged(rs, "s0", rejected)*tagged(rs, "s0", ended)+tagged(rs, "s1", rejected)*tagged(rs, "s1", ended) > 0
	})
	holder, refused, channel := "s0", "s1", "b"
	if tagged(rs, "s0", rejected) > 0 {
		holder, refused, channel = "s1", "s0", "a"
	}
	if tagged(rs, refused, func(r pageRecord) bool { return r.K == "error" && r.RS != 0 }) != 0 {
		t.Fatalf("the refused EventSource (%s) was not left CONNECTING; the page recorded:\n%s", refused, formatRecords(rs))
	}
	w.script("window.sources[arguments[0]].close()", holder)

	// the refusal was a 200 stream, which opened too: the reconnect is the
	// first open recorded after the refusal
	var refusal, reopen *pageRecord
	rs = w.waitPage(time.Now().Add(waitFor), "the refused EventSource open again once the other was closed", func(rs []pageRecord) bool {
		refusal, reopen = nil, nil
		for i, r := range rs {
			switch {
			case r.Tag != refused:
			case refusal == nil && rejected(r):
				refusal = &rs[i]
			case refusal != nil && r.K == "open":
				reopen = &rs[i]
				return true
			}
		}
		return false
	})
	if waited := reopen.T - refusal.T; waited < 4500 {
		t.Fatalf("%s reconnected %d ms after sse_rejected, before its retry: of 5000 ms; the page recorded:\n%s",
			refused, waited, formatRecords(rs))
	}
	publishEvent(t, h1Client(t, false), base+"/events", channel, "", "after the refusal")
	w.waitPage(time.Now().Add(waitFor), "an event on the stream that was refused", func(rs []pageRecord) bool {
		return tagged(rs, refused, func(r pageRecord) bool { return r.Data == "after the refusal" }) > 0
	})
}
