package caddysse

import (
	"bytes"
	"mime/multipart"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

const basicSite = `
:{PORT} {
	sse /events {
		channel {query.channels}
		publish {
			secret ` + testSecret + `
		}
	}
}
`

func TestStreamHeadersAndPreamble(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	h := c.resp.Header
	for k, want := range map[string]string{
		"Content-Type":      "text/event-stream",
		"Cache-Control":     "no-store, no-transform",
		"X-Accel-Buffering": "no",
	} {
		if got := h.Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if h.Get("X-Replay-Truncated") != "" {
		t.Error("a fresh stream must not be marked truncated")
	}
	c.comment("ok")
	srv.publish("/events", map[string]any{"channel": "a", "data": "x"})
	if ev := c.next(); ev.Retry != 3000 {
		t.Errorf("retry = %d, want the default 3000", ev.Retry)
	}
}

func TestPublishJSONReachesSubscriber(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=orders", nil)
	ids := srv.publish("/events", map[string]any{"channel": "orders", "event": "created", "data": "order 1"})
	ev := c.next()
	if ev.Type != "created" || ev.Data != "order 1" {
		t.Fatalf("got %+v", ev)
	}
	// a publish's id is the id a one-channel subscriber sees
	if ev.ID != ids["orders"] {
		t.Errorf("stream id %q != publish id %q", ev.ID, ids["orders"])
	}
	// non-string data is sent as compact JSON text
	srv.publish("/events", map[string]any{"channel": "orders", "data": map[string]any{"id": 7, "ok": true}})
	if ev := c.next(); ev.Data != `{"id":7,"ok":true}` || ev.Type != "message" {
		t.Fatalf("got %+v", ev)
	}
}

func TestPublishFormReachesSubscriber(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a,b", nil)
	status, body := srv.postForm("/events", url.Values{"channel": {"a", "b"}, "event": {"greet"}, "data": {"hello"}})
	if status != http.StatusOK || !strings.Contains(string(body), `"a":`) || !strings.Contains(string(body), `"b":`) {
		t.Fatalf("publish: %d %s", status, body)
	}
	for range 2 { // once per channel
		if ev := c.next(); ev.Type != "greet" || ev.Data != "hello" {
			t.Fatalf("got %+v", ev)
		}
	}
}

func TestMultipartFormPublish(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	body := "--XX\r\nContent-Disposition: form-data; name=\"channel\"\r\n\r\na\r\n" +
		"--XX\r\nContent-Disposition: form-data; name=\"data\"\r\n\r\nmulti\r\n--XX--\r\n"
	status, reply := srv.post("/events", "multipart/form-data; boundary=XX", []byte(body), nil)
	if status != http.StatusOK {
		t.Fatalf("publish: %d %s", status, reply)
	}
	if ev := c.next(); ev.Data != "multi" {
		t.Fatalf("got %+v", ev)
	}
}

// A file part is how `curl -F data=@event.json` sends data: it is the
// event's data (it was left out of the form's values, and the event
// published empty). The media type is case-insensitive (RFC 9110), and
// channel and event as files are refused.
func TestMultipartFormPublishWithAFilePart(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	form := func(fields map[string]string, files map[string]string) (string, []byte) {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		for name, v := range fields {
			_ = mw.WriteField(name, v)
		}
		for name, v := range files {
			fw, _ := mw.CreateFormFile(name, name+".json")
			_, _ = fw.Write([]byte(v))
		}
		_ = mw.Close()
		return mw.FormDataContentType(), body.Bytes()
	}
	ctype, body := form(map[string]string{"channel": "a"}, map[string]string{"data": `{"invoice":42}`})
	if status, reply := srv.post("/events", ctype, body, nil); status != http.StatusOK {
		t.Fatalf("publish with a data file: %d %s", status, reply)
	}
	if ev := c.next(); ev.Data != `{"invoice":42}` {
		t.Fatalf("got %+v", ev)
	}
	ctype, body = form(map[string]string{"channel": "a", "data": "upper-case media type"}, nil)
	if status, reply := srv.post("/events", strings.Replace(ctype, "multipart/form-data", "Multipart/Form-Data", 1), body, nil); status != http.StatusOK {
		t.Fatalf("publish with Multipart/Form-Data: %d %s", status, reply)
	}
	if ev := c.next(); ev.Data != "upper-case media type" {
		t.Fatalf("got %+v", ev)
	}
	for name, files := range map[string]map[string]string{
		"channel as a file":      {"channel": "a"},
		"event as a file":        {"event": "t"},
		"data as field and file": {"data": "x"},
	} {
		fields := map[string]string{"channel": "a"}
		if name == "data as field and file" {
			fields["data"] = "y"
		}
		if name == "channel as a file" {
			delete(fields, "channel")
		}
		ctype, body := form(fields, files)
		if status, reply := srv.post("/events", ctype, body, nil); status != http.StatusBadRequest || !strings.Contains(string(reply), "body_invalid") {
			t.Errorf("%s: %d %s, want 400 body_invalid", name, status, reply)
		}
	}
}

func TestDataLineBreaksAndEventTypes(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	cases := []struct{ typ, data, want string }{
		{"", "one\ntwo", "one\ntwo"},
		{"t1", "one\r\ntwo", "one\ntwo"},
		{"t2", "one\rtwo", "one\ntwo"},
		{"t3", "a\rid: 9\revent: evil\n\nretry: 1", "a\nid: 9\nevent: evil\n\nretry: 1"},
		{"", "", ""},
		{"x", "  leading spaces", "  leading spaces"},
		{"ünïcode", "日本語", "日本語"},
	}
	for _, tc := range cases {
		srv.publish("/events", map[string]any{"channel": "a", "event": tc.typ, "data": tc.data})
	}
	for _, tc := range cases {
		ev := c.next()
		wantType := tc.typ
		if wantType == "" {
			wantType = "message"
		}
		if ev.Type != wantType || ev.Data != tc.want {
			t.Errorf("published %q/%q: got type %q data %q, want %q", tc.typ, tc.data, ev.Type, ev.Data, tc.want)
		}
	}
}

func TestSitesShareTheEmbeddedHub(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /publish {
		publish {
			secret `+testSecret+`
		}
	}
}
:{PORT2} {
	sse /a/events {
		channel news
	}
	sse /b/events {
		channel news
	}
}
`)
	a := openStream(t, srv.base2+"/a/events", nil, nil)
	b := openStream(t, srv.base2+"/b/events", nil, nil)
	srv.publish("/publish", map[string]any{"channel": "news", "data": "everywhere"})
	for _, c := range []*sseClient{a, b} {
		if ev := c.next(); ev.Data != "everywhere" {
			t.Fatalf("got %+v", ev)
		}
	}
}

// namespacedSite has routes with namespaces x and y, and one without a
// namespace (that publishes too), on one embedded hub.
const namespacedSite = `
:{PORT} {
	sse /x/events {
		namespace x
		channel {query.channels}
		publish {
			secret ` + testSecret + `
		}
	}
	sse /y/events {
		namespace y
		channel {query.channels}
		publish {
			secret ` + testSecret + `
		}
	}
	sse /all/events {
		channel {query.channels}
		publish {
			secret ` + testSecret + `
		}
	}
}
`

func TestNamespacesKeepChannelsApart(t *testing.T) {
	srv := startCaddy(t, namespacedSite)
	x := srv.subscribe("/x/events?channels=a", nil)
	y := srv.subscribe("/y/events?channels=a", nil)
	all := srv.subscribe("/all/events?channels=x:a", nil)
	srv.publish("/x/events", map[string]any{"channel": "a", "data": "for x"})
	srv.publish("/y/events", map[string]any{"channel": "a", "data": "for y"})
	if ev := x.next(); ev.Data != "for x" {
		t.Fatalf("x got %+v", ev)
	}
	if ev := y.next(); ev.Data != "for y" {
		t.Fatalf("y got %+v (x's event leaked into y)", ev)
	}
	// a handler without namespace sees namespaced channels by full name
	if ev := all.next(); ev.Data != "for x" {
		t.Fatalf("all got %+v", ev)
	}
}

// A namespaced channel is bounded with its namespace (SPEC S1: the name
// events are published to is at most 200 bytes): a route with namespace x
// took 200 bytes before "x:", a channel that a route without a namespace,
// which names it "x:<name>", refused as too long. Both refuse it now, to
// subscribe and to publish, and both take the longest name they share.
func TestANamespacedChannelIsBoundedWithItsNamespace(t *testing.T) {
	srv := startCaddy(t, namespacedSite)
	tooLong, longest := strings.Repeat("c", 199), strings.Repeat("c", 198)
	for _, tc := range []struct{ path, channel string }{{"/x/events", tooLong}, {"/all/events", "x:" + tooLong}} {
		resp, err := http.Get(srv.base + tc.path + "?channels=" + tc.channel)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("subscribe %s to a channel of 201 bytes with its namespace: %d, want 400", tc.path, resp.StatusCode)
		}
		status, body := srv.post(tc.path, "application/json", mustJSON(t, map[string]any{"channel": tc.channel, "data": "d"}), nil)
		if status != http.StatusBadRequest || !strings.Contains(string(body), "channel_invalid") {
			t.Errorf("publish on %s to a channel of 201 bytes with its namespace: %d %s", tc.path, status, body)
		}
	}
	// a channel of the template's own text is checked at load
	h := validHandler()
	h.Namespace, h.Channels = "x", []string{tooLong}
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "namespace") {
		t.Errorf("a constant channel of 201 bytes with its namespace: %v, want a config error", err)
	}
	x := srv.subscribe("/x/events?channels="+longest, nil)
	srv.publish("/all/events", map[string]any{"channel": "x:" + longest, "data": "shared"})
	if ev := x.next(); ev.Data != "shared" {
		t.Fatalf("got %+v", ev)
	}
}
