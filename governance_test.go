package caddysse

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/replay"
)

// governedSite caps each principal ({query.user}) at one stream and the
// instance at two, answering temporary refusals as {MODE} says.
const governedSite = `
:{PORT} {
	sse /events {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 1
		max_connections 2
		retry 1s
		max_channels 2
		rejections {MODE}
	}
}
`

// eventually polls cond until it holds, failing the test after waitFor.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	waitfor.Until(t, what, waitFor, 10*time.Millisecond, cond)
}

// throttleForTest throttles a client in the embedded hub, as a slow
// disconnection would (TestSlowClientIsDisconnectedThrottledAndResumes
// makes one for real).
func throttleForTest(t *testing.T, principal string, d time.Duration) {
	t.Helper()
	throttleAddressForTest(t, principal, "127.0.0.1", d)
}

// throttleAddressForTest is throttleForTest for a client at ip.
func throttleAddressForTest(t *testing.T, principal, ip string, d time.Duration) {
	t.Helper()
	hub, key, err := acquireHub(nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer releaseHub(key)
	who := client{principal: principal, ip: ip}
	if err := hub.Throttles().Throttle(context.Background(), (&Handler{}).throttleKey(who), d); err != nil {
		t.Fatal(err)
	}
}

// refusal is a temporary refusal as the client sees it, in either mode.
type refusal struct {
	status     int
	code       string
	retryAfter int // seconds, from the header
	retryMs    int // from the stream's retry: field (in_stream only)
	detail     string
	id         string // in_stream: the client's own cursor, said back before the refusal
}

// getRefusal GETs path and reads the refusal, whichever mode answers it.
// Reading the whole body proves that an in-stream refusal ends; a request
// admitted as a real stream fails the test at the client's timeout.
func (s *testServer) getRefusal(path string) refusal {
	s.t.Helper()
	client := &http.Client{Timeout: waitFor, Transport: &http.Transport{DisableCompression: true}}
	resp, err := client.Get(s.base + path)
	if err != nil {
		s.t.Fatalf("GET %s: %v", path, err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		s.t.Fatalf("GET %s: reading the body: %v (a stream that did not end?)", path, err)
	}
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	out := refusal{status: resp.StatusCode, retryAfter: ra, retryMs: -1}
	var e errorBody
	if resp.StatusCode != http.StatusOK {
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			s.t.Errorf("GET %s: Content-Type %q", path, ct)
		}
		if err := json.Unmarshal(body, &e); err != nil {
			s.t.Fatalf("GET %s: status %d, body %q is not a JSON refusal", path, resp.StatusCode, body)
		}
		out.code, out.detail = e.Error, e.Detail
		return out
	}
	// an in-stream refusal is a stream like any other to caches and proxies
	for name, want := range map[string]string{"Content-Type": "text/event-stream", "Cache-Control": "no-store, no-transform", "X-Accel-Buffering": "no"} {
		if got := resp.Header.Get(name); got != want {
			s.t.Fatalf("GET %s: in-stream refusal with %s %q, want %q", path, name, got, want)
		}
	}
	// exactly: the client's cursor said back if it came with one, the retry
	// hint, one sse_rejected event without an id, the end
	lines := strings.Split(string(body), "\n")
	if id, ok := strings.CutPrefix(lines[0], "id: "); ok && len(lines) > 1 && lines[1] == "" {
		out.id, lines = id, lines[2:]
	}
	if len(lines) != 5 || !strings.HasPrefix(lines[0], "retry: ") || lines[1] != "event: sse_rejected" ||
		!strings.HasPrefix(lines[2], "data: ") || lines[3] != "" || lines[4] != "" {
		s.t.Fatalf("GET %s: in-stream refusal %q", path, body)
	}
	out.retryMs, _ = strconv.Atoi(strings.TrimPrefix(lines[0], "retry: "))
	if err := json.Unmarshal([]byte(strings.TrimPrefix(lines[2], "data: ")), &e); err != nil {
		s.t.Fatalf("sse_rejected data %q: %v", lines[2], err)
	}
	out.code, out.detail = e.Error, e.Detail
	return out
}

func TestTemporaryRejectionsInBothModes(t *testing.T) {
	for _, mode := range []string{rejectionsStatus, rejectionsInStream} {
		t.Run(mode, func(t *testing.T) {
			srv := startCaddy(t, strings.ReplaceAll(governedSite, "{MODE}", mode))
			throttleForTest(t, "slowpoke", 30*time.Second)
			check := func(path string, status int, code string, minRetry, maxRetry int) {
				t.Helper()
				got := srv.getRefusal(path)
				wantStatus := status
				if mode == rejectionsInStream {
					wantStatus = http.StatusOK
				}
				if got.status != wantStatus || got.code != code {
					t.Fatalf("GET %s: %d %s, want %d %s", path, got.status, got.code, wantStatus, code)
				}
				if got.retryAfter < minRetry || got.retryAfter > maxRetry {
					t.Errorf("GET %s: Retry-After %d, want %d to %d", path, got.retryAfter, minRetry, maxRetry)
				}
				if mode == rejectionsInStream && got.retryMs != got.retryAfter*1000 {
					t.Errorf("GET %s: retry: %d ms, want Retry-After (%d s) in ms", path, got.retryMs, got.retryAfter)
				}
			}

			srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
			// the principal's cap: 1 stream
			check("/events?channels=a&user=u1", 429, "too_many_connections", 5, 5)
			if got := srv.getRefusal("/events?channels=a&user=u1"); got.detail != "at most 1 stream per principal" {
				t.Errorf("the cap's detail %q", got.detail)
			}
			srv.subscribe("/events?channels=a&user=u2", nil).comment("ok")
			// the instance's cap: 2 streams
			check("/events?channels=a&user=u3", 503, "server_full", 5, 5)
			// the order of SPEC S2: throttled, then the principal's cap, then the instance's
			check("/events?channels=a&user=slowpoke", 429, "throttled", 29, 30)
			check("/events?channels=a&user=u1", 429, "too_many_connections", 5, 5)

			// configuration-level refusals are status codes in both modes
			// (and the principal is checked first)
			assertError(t, do(t, http.MethodGet, srv.base+"/events?channels=a", nil, ""), 401, "principal_unresolved")
			assertError(t, do(t, http.MethodGet, srv.base+"/events", nil, ""), 401, "principal_unresolved")
			assertError(t, do(t, http.MethodGet, srv.base+"/events?user=u4", nil, ""), 403, "channel_unresolved")
			assertError(t, do(t, http.MethodGet, srv.base+"/events?user=u4&channels=a,b,c", nil, ""), 400, "too_many_channels")
			assertError(t, do(t, http.MethodPut, srv.base+"/events?user=u4&channels=a", nil, ""), 405, "method_not_allowed")
		})
	}
}

// A cap's Retry-After is max(retry, 5s) (README, "Status codes"): the
// site above has retry 1s and gets 5; one whose clients are told to wait
// longer between reconnects is not told to come back sooner by a refusal.
func TestCapRetryAfterIsTheRetryWhenLonger(t *testing.T) {
	for _, mode := range []string{rejectionsStatus, rejectionsInStream} {
		t.Run(mode, func(t *testing.T) {
			site := strings.ReplaceAll(strings.ReplaceAll(governedSite, "{MODE}", mode), "retry 1s", "retry 7s")
			srv := startCaddy(t, site)
			srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
			srv.subscribe("/events?channels=a&user=u2", nil).comment("ok")
			for path, code := range map[string]string{
				"/events?channels=a&user=u1": "too_many_connections",
				"/events?channels=a&user=u3": "server_full",
			} {
				got := srv.getRefusal(path)
				if got.code != code || got.retryAfter != 7 || (mode == rejectionsInStream && got.retryMs != 7000) {
					t.Errorf("GET %s: %+v, want %s with Retry-After 7 (retry: 7000 in the stream)", path, got, code)
				}
			}
		})
	}
}

// HEAD is checked like GET: the same status (or the in-stream 200) and
// headers, without a body; it holds no slot once answered.
func TestHeadIsGovernedLikeGet(t *testing.T) {
	for _, mode := range []string{rejectionsStatus, rejectionsInStream} {
		t.Run(mode, func(t *testing.T) {
			srv := startCaddy(t, strings.ReplaceAll(governedSite, "{MODE}", mode))
			for range 3 { // a HEAD gives its slot back at once
				head := do(t, http.MethodHead, srv.base+"/events?channels=a&user=u1", nil, "")
				head.Body.Close()
				if head.StatusCode != 200 || head.Header.Get("Content-Type") != "text/event-stream" {
					t.Fatalf("HEAD: %d %v", head.StatusCode, head.Header)
				}
			}
			srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
			head := do(t, http.MethodHead, srv.base+"/events?channels=a&user=u1", nil, "")
			body, _ := io.ReadAll(head.Body)
			head.Body.Close()
			want := 429
			if mode == rejectionsInStream {
				want = 200
			}
			if head.StatusCode != want || head.Header.Get("Retry-After") != "5" || len(body) != 0 {
				t.Fatalf("HEAD over the cap: %d, Retry-After %q, body %q; want %d, 5, none", head.StatusCode, head.Header.Get("Retry-After"), body, want)
			}
		})
	}
}

func TestUnresolvedPrincipal(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		principal {http.request.header.X-Wallet}
		rejections in_stream
	}
	sse /query {
		channel a
		principal {query.w}
	}
}
`)
	cases := []struct {
		name, path string
		hdr        http.Header
	}{
		{"missing header", "/events", nil},
		{"empty header", "/events", header("X-Wallet", "")},
		{"blank header", "/events", header("X-Wallet", "   ")},
		{"blank query", "/query?w=%20%20", nil}, // net/http does not trim it as it trims headers
		{"too long", "/events", header("X-Wallet", strings.Repeat("w", 201))},
		{"control character", "/query?w=a%01b", nil},
		{"not utf-8", "/query?w=a%FFb", nil},
		{"missing query", "/query", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assertError(t, do(t, http.MethodGet, srv.base+tc.path, tc.hdr, ""), 401, "principal_unresolved")
		})
	}
	srv.subscribe("/query?w=%C3%BCber%20user", nil).comment("ok")
	c := srv.subscribe("/events", header("X-Wallet", "w-1"))
	c.comment("ok")
}

// 20 connects of one principal racing for its 2 slots: exactly 2 get in;
// a slot is free again once its stream ends.
func TestConcurrentConnectsRaceForTwoSlots(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		principal {query.user}
		max_connections_per_principal 2
	}
}
`)
	const racers = 20
	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make(chan *http.Response, racers)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	for range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.base+"/events?user=racer", nil)
			<-start
			resp, err := client.Do(req)
			if err != nil {
				t.Errorf("GET: %v", err)
				return
			}
			results <- resp
		}()
	}
	close(start)
	wg.Wait()
	close(results)
	var admitted []*http.Response
	refused := 0
	for resp := range results {
		switch resp.StatusCode {
		case 200:
			admitted = append(admitted, resp)
		case 429:
			refused++
			assertError(t, resp, 429, "too_many_connections")
		default:
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	if len(admitted) != 2 || refused != racers-2 {
		t.Fatalf("%d admitted and %d refused of %d racing for 2 slots", len(admitted), refused, racers)
	}
	// other principals are not capped by this one
	srv.subscribe("/events?user=other", nil).comment("ok")

	admitted[0].Body.Close()
	eventually(t, "a slot freed by a closed stream", func() bool {
		resp := do(t, http.MethodHead, srv.base+"/events?user=racer", nil, "")
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	resp := do(t, http.MethodHead, srv.base+"/events?user=racer", nil, "")
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("a HEAD kept the freed slot: %d", resp.StatusCode)
	}
	admitted[1].Body.Close()
}

// The instance cap counts every stream of the process on the same hub, in
// whichever site or route: a handler compares that count with its own cap.
func TestInstanceCapCountsStreamsOfEveryHandler(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /capped {
		channel a
		max_connections 2
	}
}
:{PORT2} {
	sse /open {
		channel b
	}
}
`)
	first := openStream(t, srv.base2+"/open", nil, nil)
	first.comment("ok")
	srv.subscribe("/capped", nil).comment("ok")
	resp := do(t, http.MethodGet, srv.base+"/capped", nil, "")
	if resp.Header.Get("Retry-After") != "5" {
		t.Errorf("Retry-After %q, want 5", resp.Header.Get("Retry-After"))
	}
	assertError(t, resp, 503, "server_full")
	// the uncapped handler still admits
	second := openStream(t, srv.base2+"/open", nil, nil)
	second.comment("ok")

	first.close()
	second.close()
	eventually(t, "room after the streams of another handler ended", func() bool {
		resp := do(t, http.MethodHead, srv.base+"/capped", nil, "")
		resp.Body.Close()
		return resp.StatusCode == 200
	})
}

// dialFrom returns an HTTP client whose connections come from the loopback
// address ip (Linux routes all of 127/8 to lo), to be another remote
// address than the tests' 127.0.0.1.
func dialFrom(ip string) *http.Client {
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Transport: &http.Transport{DialContext: dialer.DialContext, DisableCompression: true}}
}

// A throttle applies to the principal from its remote address: the same
// user on another address, and other users on the same address, are
// admitted; without a principal the address alone is throttled.
func TestThrottleIsPerPrincipalAndAddress(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		principal {query.user}
	}
	sse /anonymous {
		channel a
	}
}
`)
	throttleForTest(t, "u1", 30*time.Second)
	throttleForTest(t, "", 30*time.Second)
	assertError(t, do(t, http.MethodGet, srv.base+"/events?user=u1", nil, ""), 429, "throttled")
	assertError(t, do(t, http.MethodGet, srv.base+"/anonymous", nil, ""), 429, "throttled")
	srv.subscribe("/events?user=u2", nil).comment("ok")
	elsewhere := openStream(t, srv.base+"/events?user=u1", nil, dialFrom("127.0.0.2"))
	if elsewhere.resp.StatusCode != 200 {
		t.Fatalf("the throttled principal from another address: %d, want 200", elsewhere.resp.StatusCode)
	}
	anonElsewhere := openStream(t, srv.base+"/anonymous", nil, dialFrom("127.0.0.2"))
	if anonElsewhere.resp.StatusCode != 200 {
		t.Fatalf("another address without a principal: %d, want 200", anonElsewhere.resp.StatusCode)
	}
}

// Behind a proxy the throttle's address is Caddy's client IP: with
// trusted_proxies, the address the proxy forwards (README, Governance), so
// that one slow client behind a load balancer does not throttle everyone
// behind it; without, X-Forwarded-For is ignored, so that a client cannot
// name another address to leave its throttle behind.
func TestThrottleAddressIsTheClientIPBehindATrustedProxy(t *testing.T) {
	site := `
:{PORT} {
	sse /events {
		channel a
		principal {query.user}
	}
}
`
	get := func(srv *testServer, forwardedFor string) int {
		var h http.Header
		if forwardedFor != "" {
			h = header("X-Forwarded-For", forwardedFor)
		}
		c := openStream(t, srv.base+"/events?user=u1", h, nil)
		defer c.close()
		return c.resp.StatusCode
	}

	srv := startCaddy(t, site, "servers {\n\t\ttrusted_proxies static 127.0.0.0/8\n\t}")
	throttleAddressForTest(t, "u1", "203.0.113.7", 30*time.Second)
	for forwarded, want := range map[string]int{"203.0.113.7": 429, "203.0.113.8": 200, "": 200} {
		if got := get(srv, forwarded); got != want {
			t.Errorf("trusted proxy forwarding %q: %d, want %d", forwarded, got, want)
		}
	}

	srv = startCaddy(t, site)
	throttleForTest(t, "u1", 30*time.Second)
	if got := get(srv, "203.0.113.8"); got != 429 {
		t.Errorf("an untrusted X-Forwarded-For left the throttle behind: %d, want 429", got)
	}
}

// The handler exports the stream's channels and principal as placeholders
// (for access logs); a deferred header shows them as set by the time the
// response starts.
func TestPlaceholdersOfTheStream(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	header {
		defer
		X-Channels "{http.sse.channels}"
		X-Principal "{http.sse.principal}"
	}
	sse /events {
		channel {query.channels}
		principal {query.user}
	}
}
`)
	c := srv.subscribe("/events?channels=a,b&user=u%207", nil)
	if got := c.resp.Header.Get("X-Channels"); got != "a,b" {
		t.Errorf("{http.sse.channels} = %q", got)
	}
	if got := c.resp.Header.Get("X-Principal"); got != "u 7" {
		t.Errorf("{http.sse.principal} = %q", got)
	}
}

// An in-stream refusal gives a client that came with a cursor its cursor
// back, in an id-only block before the sse_rejected event: the EventSource's
// last event ID buffer starts empty on each connection, and the event's
// dispatch would otherwise set its Last-Event-ID to "", so that the retry
// it asks for would start live and lose what was published meanwhile.
func TestAnInStreamRefusalGivesTheClientsCursorBack(t *testing.T) {
	srv := startCaddy(t, strings.ReplaceAll(governedSite, "{MODE}", rejectionsInStream))
	throttleForTest(t, "slowpoke", 30*time.Second)
	cursor := replay.EncodeCursor(replay.ChannelPosition{Hash: replay.HashChannel("a"),
		Pos: replay.Position{Epoch: 7, Seq: 42, Time: time.Now().UnixMilli()}})
	for name, hdr := range map[string]http.Header{
		"header": header("Last-Event-ID", cursor),
		"query":  nil,
	} {
		t.Run(name, func(t *testing.T) {
			url := srv.base + "/events?channels=a&user=slowpoke"
			if hdr == nil {
				url += "&lastEventID=" + cursor
			}
			c := openStream(t, url, hdr, nil)
			ev := c.next()
			if ev.Type != "sse_rejected" || !strings.Contains(ev.Data, `"throttled"`) {
				t.Fatalf("got %+v, want an sse_rejected event", ev)
			}
			if ev.ID != cursor || ev.OwnID {
				t.Errorf("Last-Event-ID at the refusal %q (own id %v), want the client's cursor %q in a block of its own", ev.ID, ev.OwnID, cursor)
			}
			c.expectEnd()
			if got := c.lastSeenID.Load(); got == nil || *got != cursor {
				t.Errorf("Last-Event-ID after the refusal %v, want the client's cursor %q", got, cursor)
			}
		})
	}
}

// The Retry-After of a throttled client is not before the throttle ends
// (it is rounded up to whole seconds): a client that waits as told is not
// refused again.
func TestThrottledRetryAfterIsNotBeforeTheThrottleEnds(t *testing.T) {
	srv := startCaddy(t, strings.ReplaceAll(governedSite, "{MODE}", rejectionsStatus))
	const throttle = 1500 * time.Millisecond
	start := time.Now()
	throttleForTest(t, "slowpoke", throttle)
	got := srv.getRefusal("/events?channels=a&user=slowpoke")
	elapsed := time.Since(start)
	if got.status != http.StatusTooManyRequests || got.code != "throttled" {
		t.Fatalf("got %d %s, want 429 throttled", got.status, got.code)
	}
	// the throttle had at least throttle-elapsed left when it was answered
	if left := throttle - elapsed; time.Duration(got.retryAfter)*time.Second < left {
		t.Fatalf("Retry-After %d s, but the throttle had %v left", got.retryAfter, left)
	}
}

// A principal's cap and throttle are per namespace: tenants (or sites)
// that share a hub may share principal ids, and one tenant's streams do not
// count against another's user of the same id, nor is that user refused
// for the other's slow client.
func TestPrincipalsCapAndThrottleArePerNamespace(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /one {
		channel a
		namespace one
		principal {query.user}
		max_connections_per_principal 1
	}
	sse /two {
		channel a
		namespace two
		principal {query.user}
		max_connections_per_principal 1
	}
}
`)
	srv.subscribe("/one?user=u", nil).comment("ok")
	assertError(t, do(t, http.MethodGet, srv.base+"/one?user=u", nil, ""), 429, "too_many_connections")
	srv.subscribe("/two?user=u", nil).comment("ok")
	assertError(t, do(t, http.MethodGet, srv.base+"/two?user=u", nil, ""), 429, "too_many_connections")

	hub, key, err := acquireHub(nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer releaseHub(key)
	slow := client{principal: "slow", ip: "127.0.0.1"}
	if err := hub.Throttles().Throttle(context.Background(), (&Handler{Namespace: "one"}).throttleKey(slow), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	assertError(t, do(t, http.MethodGet, srv.base+"/one?user=slow", nil, ""), 429, "throttled")
	srv.subscribe("/two?user=slow", nil).comment("ok")
}
