package caddysse

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/replay"
)

const rejectSite = `
:{PORT} {
	sse /events {
		channel {query.channels}
		max_channels 2
		max_event_size 1KiB
		publish {
			secret ` + testSecret + `
		}
	}
	sse /user/events {
		channel user:{http.request.header.X-User}
	}
	sse /publish-only {
		publish {
			secret ` + testSecret + `
		}
	}
	handle /options/* {
		respond "preflight passed on" 204
	}
}
`

// assertError checks a refusal: status and JSON {"error": code}. A stream
// answered instead fails at once (its body would never end).
func assertError(t *testing.T, resp *http.Response, status int, code string) {
	t.Helper()
	defer resp.Body.Close()
	if resp.StatusCode != status && resp.Header.Get("Content-Type") == "text/event-stream" {
		t.Fatalf("status %d (a stream), want %d", resp.StatusCode, status)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d (body %s)", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	if got := resp.Header.Get("WWW-Authenticate"); status == http.StatusUnauthorized && got != `Bearer realm="sse"` {
		t.Errorf("401 %s with WWW-Authenticate %q, want the README's Bearer realm=\"sse\" (RFC 9110: a 401 carries a challenge)", code, got)
	}
	var out struct {
		Error string `json:"error"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.Error != code {
		t.Fatalf("body %s, want error %q", body, code)
	}
}

func do(t *testing.T, method, url string, hdr http.Header, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := doAcrossReloads(requestClient, req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func TestSubscribeRejections(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	cases := []struct {
		name, path string
		hdr        http.Header
		status     int
		code       string
	}{
		{"missing query placeholder", "/events", nil, 403, "channel_unresolved"},
		{"empty query value", "/events?channels=", nil, 403, "channel_unresolved"},
		{"missing header placeholder", "/user/events", nil, 403, "channel_unresolved"},
		{"empty header placeholder", "/user/events", header("X-User", ""), 403, "channel_unresolved"},
		{"brace in name", "/events?channels=a%7Bb", nil, 400, "channel_invalid"},
		{"control character", "/events?channels=a%01b", nil, 400, "channel_invalid"},
		{"empty item in list", "/events?channels=a,,b", nil, 400, "channel_invalid"},
		{"too long", "/events?channels=" + strings.Repeat("x", 201), nil, 400, "channel_invalid"},
		{"too many channels", "/events?channels=a,b,c", nil, 400, "too_many_channels"},
		{"channels whose hashes collide", "/events?channels=t439599,t622382", nil, 400, "channel_invalid"},
		{"subscribe on publish-only route", "/publish-only", nil, 405, "method_not_allowed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assertError(t, do(t, http.MethodGet, srv.base+tc.path, tc.hdr, ""), tc.status, tc.code)
		})
	}
	t.Run("duplicates count once", func(t *testing.T) {
		srv.subscribe("/events?channels=a,b,a", nil)
	})
	t.Run("resolved header channel", func(t *testing.T) {
		c := srv.subscribe("/user/events", header("X-User", "42"))
		srv.publish("/publish-only", map[string]any{"channel": "user:42", "data": "hi 42"})
		if ev := c.next(); ev.Data != "hi 42" {
			t.Fatalf("got %+v", ev)
		}
	})
}

// Two channels of one stream whose hashes collide (FNV-1a, 32 bits) would
// get each other's positions in its ids: a client that missed nothing
// would be told truncated and get duplicates on every reconnect. Such a
// stream is refused, naming both; each channel alone is fine, and so is
// the pair where a namespace makes their names in the hub differ. The
// hash is of the name in the hub: a namespaced pair can collide too.
func TestCollidingChannelHashesAreRefused(t *testing.T) {
	a, b := "t439599", "t622382"
	if replay.HashChannel(a) != replay.HashChannel(b) {
		t.Fatal("the names do not collide")
	}
	// a pair whose names collide only with the namespace
	var na, nb string
	seen := map[uint32]string{}
	for i := 0; nb == ""; i++ {
		name := "n" + strconv.Itoa(i)
		h := replay.HashChannel("ns:" + name)
		if other, ok := seen[h]; ok {
			na, nb = other, name
		}
		seen[h] = name
	}
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		publish {
			secret `+testSecret+`
		}
	}
	sse /ns/events {
		namespace ns
		channel {query.channels}
	}
}
`)
	many := make([]string, 20) // more than a stream's usual few
	for i := range many {
		many[i] = "c" + strconv.Itoa(i)
	}
	for _, tc := range []struct{ path, others, a, b string }{
		{"/events", "x", a, b},
		{"/events", strings.Join(many, ","), a, b},
		{"/ns/events", "x", na, nb},
	} {
		resp := do(t, http.MethodGet, srv.base+tc.path+"?channels="+tc.others+","+tc.a+","+tc.b, nil, "")
		if resp.StatusCode != 400 {
			resp.Body.Close() // a stream's body never ends
			t.Fatalf("%s: status %d, want 400", tc.path, resp.StatusCode)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var out struct{ Error, Detail string }
		if err := json.Unmarshal(body, &out); err != nil || out.Error != "channel_invalid" {
			t.Fatalf("%s: body %s, want error channel_invalid", tc.path, body)
		}
		for _, want := range []string{strconv.Quote(tc.a), strconv.Quote(tc.b), "separate streams"} {
			if !strings.Contains(out.Detail, want) {
				t.Errorf("%s: detail %q does not say %s", tc.path, out.Detail, want)
			}
		}
	}
	if n := embeddedHub(t).Subscribers(a); n != 0 {
		t.Errorf("the refused stream left %d subscriptions", n)
	}
	// on separate streams, each channel resumes on its own
	ca := srv.subscribe("/events?channels="+a, nil)
	cb := srv.subscribe("/events?channels="+b, nil)
	srv.publish("/events", map[string]any{"channel": a, "data": "a1"})
	srv.publish("/events", map[string]any{"channel": b, "data": "b1"})
	if ev := ca.next(); ev.Data != "a1" {
		t.Fatalf("got %+v", ev)
	}
	if ev := cb.next(); ev.Data != "b1" {
		t.Fatalf("got %+v", ev)
	}
	// with a namespace, the names in the hub of a and b do not collide
	srv.subscribe("/ns/events?channels="+a+","+b, nil)
}

func TestMethodsAndHead(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	resp := do(t, http.MethodPut, srv.base+"/events?channels=a", nil, "")
	if allow := resp.Header.Get("Allow"); allow != "GET, HEAD, POST" {
		t.Errorf("Allow = %q", allow)
	}
	assertError(t, resp, 405, "method_not_allowed")

	resp = do(t, http.MethodPost, srv.base+"/user/events", header("X-User", "1"), "")
	if allow := resp.Header.Get("Allow"); allow != "GET, HEAD" {
		t.Errorf("Allow = %q", allow)
	}
	assertError(t, resp, 405, "method_not_allowed")

	// HEAD answers like GET, without a body
	head := do(t, http.MethodHead, srv.base+"/events?channels=a", nil, "")
	head.Body.Close()
	if head.StatusCode != 200 || head.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("HEAD: %d %v", head.StatusCode, head.Header)
	}
	head = do(t, http.MethodHead, srv.base+"/events", nil, "")
	head.Body.Close()
	if head.StatusCode != 403 {
		t.Fatalf("HEAD of an unresolved channel: %d, want 403", head.StatusCode)
	}
}

func TestOptionsPassesToTheNextHandler(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	route {
		sse /events {
			channel a
		}
		respond "next handler" 200
	}
}
`)
	resp := do(t, http.MethodOptions, srv.base+"/events", nil, "")
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != "next handler" {
		t.Fatalf("OPTIONS: %d %q", resp.StatusCode, body)
	}
}

func TestPublishRejections(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	jsonHdr := header("Content-Type", "application/json", "Authorization", "Bearer "+testSecret)
	cases := []struct {
		name   string
		hdr    http.Header
		body   string
		status int
		code   string
	}{
		{"no secret", header("Content-Type", "application/json"), `{"channel":"a"}`, 401, "unauthorized"},
		{"wrong secret", header("Content-Type", "application/json", "Authorization", "Bearer nope"), `{"channel":"a"}`, 401, "unauthorized"},
		{"basic auth", header("Content-Type", "application/json", "Authorization", "Basic "+testSecret), `{"channel":"a"}`, 401, "unauthorized"},
		{"bad json", jsonHdr, `{"channel":`, 400, "json_invalid"},
		{"unknown field", jsonHdr, `{"chanel":"a"}`, 400, "json_invalid"},
		{"trailing data", jsonHdr, `{"channel":"a"} {}`, 400, "json_invalid"},
		{"a stray closing brace", jsonHdr, `{"channel":"a","data":"x"}}`, 400, "json_invalid"},
		{"stray closing brackets", jsonHdr, `{"channel":"a","data":"x"} ]]]`, 400, "json_invalid"},
		{"not an object", jsonHdr, `["a"]`, 400, "json_invalid"},
		// the last of a repeated field would win: a proxy that checked the
		// first would not have checked what is published
		{"a field given twice", jsonHdr, `{"channel":"a","channel":"b"}`, 400, "json_invalid"},
		{"a field in other case", jsonHdr, `{"channel":"a","Channel":"b"}`, 400, "json_invalid"},
		{"data given twice", jsonHdr, `{"channel":"a","data":"x","data":"y"}`, 400, "json_invalid"},
		{"a content encoding", header("Content-Type", "application/json", "Content-Encoding", "gzip", "Authorization", "Bearer "+testSecret), `{"channel":"a"}`, 415, "unsupported_media_type"},
		{"no channel", jsonHdr, `{"data":"x"}`, 400, "channel_missing"},
		{"channel not a string", jsonHdr, `{"channel":5}`, 400, "channel_invalid"},
		{"invalid channel", jsonHdr, `{"channel":"a,b"}`, 400, "channel_invalid"},
		{"channel with DEL", jsonHdr, `{"channel":"a\u007fb"}`, 400, "channel_invalid"},
		{"channel with a C1 control (NEL)", jsonHdr, `{"channel":"a\u0085b"}`, 400, "channel_invalid"},
		{"channel with white space around it", jsonHdr, `{"channel":"a "}`, 400, "channel_invalid"},
		{"channel with white space before it", jsonHdr, `{"channel":["b","\u00a0a"]}`, 400, "channel_invalid"},
		{"too many channels", jsonHdr, `{"channel":["a","b","c"]}`, 400, "too_many_channels"},
		{"reserved event type", jsonHdr, `{"channel":"a","event":"server_closing"}`, 400, "event_reserved"},
		{"event type with newline", jsonHdr, `{"channel":"a","event":"x\ny"}`, 400, "event_invalid"},
		{"not utf-8", jsonHdr, "{\"channel\":\"a\",\"data\":\"\xff\"}", 400, "body_invalid"},
		{"lone surrogate", jsonHdr, `{"channel":"a","data":"\ud800"}`, 400, "data_invalid"},
		{"lone low surrogate", jsonHdr, `{"channel":"a","data":"x\udc00y"}`, 400, "data_invalid"},
		{"lone surrogate after an escaped backslash and ufffd", jsonHdr, `{"channel":"a","data":"\\ufffd\ud800"}`, 400, "data_invalid"},
		{"lone surrogate in the event type", jsonHdr, `{"channel":"a","event":"\ud800","data":"x"}`, 400, "event_invalid"},
		{"lone surrogate in a channel", jsonHdr, `{"channel":"\ud800","data":"x"}`, 400, "channel_invalid"},
		{"event type not a string", jsonHdr, `{"channel":"a","event":5}`, 400, "event_invalid"},
		{"too large", jsonHdr, `{"channel":"a","data":"` + strings.Repeat("x", 1025) + `"}`, 413, "event_too_large"},
		{"far too large", jsonHdr, `{"channel":"a","data":"` + strings.Repeat("x", 200<<10) + `"}`, 413, "event_too_large"},
		// the client is still sending when the server refuses: it must get the
		// 413, not a reset connection
		{"megabytes too large", jsonHdr, `{"channel":"a","data":"` + strings.Repeat("x", 3<<20) + `"}`, 413, "event_too_large"},
		{"no content type", header("Authorization", "Bearer "+testSecret), `{"channel":"a"}`, 415, "unsupported_media_type"},
		{"form not utf-8", header("Content-Type", "application/x-www-form-urlencoded", "Authorization", "Bearer "+testSecret), "channel=a&data=%FF", 400, "data_invalid"},
		{"form event not utf-8", header("Content-Type", "application/x-www-form-urlencoded", "Authorization", "Bearer "+testSecret), "channel=a&event=%FF&data=x", 400, "event_invalid"},
		{"form event given twice", header("Content-Type", "application/x-www-form-urlencoded", "Authorization", "Bearer "+testSecret), "channel=a&event=x&event=y&data=d", 400, "body_invalid"},
		{"idempotency key over 255 bytes", header("Content-Type", "application/json", "Authorization", "Bearer "+testSecret, "Idempotency-Key", strings.Repeat("k", 256)), `{"channel":"a","data":"x"}`, 400, "idempotency_key_invalid"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := do(t, http.MethodPost, srv.base+"/events", tc.hdr, tc.body)
			assertError(t, resp, tc.status, tc.code)
		})
	}
	t.Run("exactly max_event_size is accepted", func(t *testing.T) {
		resp := do(t, http.MethodPost, srv.base+"/events", jsonHdr, `{"channel":"a","data":"`+strings.Repeat("x", 1024)+`"}`)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	})
	// what a client may send, by the standards, is published
	for name, hdr := range map[string]http.Header{
		"a bearer scheme in lower case (RFC 9110: case-insensitive)": header("Content-Type", "application/json", "Authorization", "bearer "+testSecret),
		"more than one space after the scheme (RFC 6750: 1*SP)":      header("Content-Type", "application/json", "Authorization", "Bearer   "+testSecret),
		"a +json media type (RFC 6839)":                              header("Content-Type", "application/vnd.example+json", "Authorization", "Bearer "+testSecret),
		"an idempotency key of 255 bytes":                            header("Content-Type", "application/json", "Authorization", "Bearer "+testSecret, "Idempotency-Key", strings.Repeat("k", 255)),
	} {
		t.Run(name, func(t *testing.T) {
			resp := do(t, http.MethodPost, srv.base+"/events", hdr, `{"channel":"a","data":"x"}`)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d %s", resp.StatusCode, body)
			}
		})
	}
	for name, body := range map[string]string{
		"a channel named thrice counts once":           `{"channel":["a","a","a"],"data":"x"}`,
		"escaped U+FFFD is data, not a lone surrogate": `{"channel":"a","data":"\ufffd"}`,
		"a surrogate pair is one character":            `{"channel":"a","event":"\ud83d\ude00","data":"\uD83D\uDE00"}`,
		"an escaped backslash before ud800 is text":    `{"channel":"a","data":"\\ud800"}`,
	} {
		t.Run(name, func(t *testing.T) {
			resp := do(t, http.MethodPost, srv.base+"/events", jsonHdr, body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
		})
	}
}

func TestRejectedPublishDeliversNothing(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	c := srv.subscribe("/events?channels=a", nil)
	resp := do(t, http.MethodPost, srv.base+"/events", header("Content-Type", "application/json"), `{"channel":"a","data":"unauthorized"}`)
	resp.Body.Close()
	srv.publish("/events", map[string]any{"channel": "a", "data": "authorized"})
	if ev := c.next(); ev.Data != "authorized" {
		t.Fatalf("got %+v: a refused publish was delivered", ev)
	}
}

func TestEmptySecretIsAConfigError(t *testing.T) {
	cfg := adapt(t, globalOptions("")+`
:`+itoa(freePort(t))+` {
	sse /events {
		channel a
		publish {
			secret {env.CADDY_SSE_TEST_UNSET_SECRET}
		}
	}
}
`)
	err := caddy.Load(cfg, true)
	if err == nil {
		_ = caddy.Stop()
		t.Fatal("a publish secret that resolves to nothing must fail provisioning")
	}
	if !strings.Contains(err.Error(), "secret is empty") {
		t.Fatalf("error %q does not say the secret is empty", err)
	}
}

// A secret with a placeholder unknown at load (a request placeholder, a
// typo) is refused as such, not as an empty secret.
func TestSecretWithAnUnknownPlaceholderIsAConfigError(t *testing.T) {
	h := validHandler()
	h.Publish = &PublishConfig{Secret: "{http.request.header.X-Secret}"}
	err := h.provisionSecret()
	if err == nil || !strings.Contains(err.Error(), "not known at load") {
		t.Fatalf("error %v, want one saying the placeholder is not known at load", err)
	}
}

// A secret read from an environment variable may end with a newline (an env
// file, a mounted secret written with echo). A header cannot carry it, so
// the secret is taken without the whitespace around it: publishing works.
func TestASecretEndingInANewlineCanBeUsed(t *testing.T) {
	t.Setenv("CADDY_SSE_TEST_SECRET", testSecret+"\n")
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		publish {
			secret {env.CADDY_SSE_TEST_SECRET}
		}
	}
}
`)
	status, body := srv.post("/events", "application/json", []byte(`{"channel":"a","data":"x"}`), nil)
	if status != http.StatusOK {
		t.Fatalf("publish with the configured secret: %d %s", status, body)
	}
}

// The body limit makes room for every channel a publish may name: one to
// max_channels channels of long names, with small events, is a valid
// publish, not 413 event_too_large.
func TestAPublishToMaxChannelsOfLongNamesIsAccepted(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		max_channels 400
		max_event_size 1KiB
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	channels := make([]string, 400)
	for i := range channels {
		channels[i] = fmt.Sprintf("%03d-%s", i, strings.Repeat("x", MaxChannelNameLen-4))
	}
	ids := srv.publish("/events", map[string]any{"channel": channels, "data": "to all"})
	if len(ids) != len(channels) {
		t.Fatalf("%d ids for %d channels", len(ids), len(channels))
	}
}

// A publish refused before its body is read (wrong secret, unsupported
// media type, method) gets its answer even while the client is still
// sending a large body, as a 413 does: net/http reads at most 256 KiB of
// a body its handler left, then closes the connection with the rest
// unread, which resets it, and the client (still writing) often saw the
// reset instead of the refusal.
func TestARefusalBeforeTheBodyIsReadIsAnswered(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	body := `{"channel":"a","data":"` + strings.Repeat("x", 1<<20) + `"}`
	cases := []struct {
		name, method, path string
		hdr                http.Header
		status             int
		code               string
	}{
		{"wrong secret", http.MethodPost, "/events", header("Content-Type", "application/json", "Authorization", "Bearer nope"), 401, "unauthorized"},
		{"unsupported media type", http.MethodPost, "/events", header("Content-Type", "text/plain", "Authorization", "Bearer "+testSecret), 415, "unsupported_media_type"},
		{"method not allowed", http.MethodPut, "/events", header("Content-Type", "application/json"), 405, "method_not_allowed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for range 20 {
				req, err := http.NewRequest(tc.method, srv.base+tc.path, strings.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				req.Header = tc.hdr.Clone()
				resp, err := requestClient.Do(req)
				if err != nil {
					t.Fatalf("no answer: %v", err)
				}
				assertError(t, resp, tc.status, tc.code)
			}
		})
	}
}
