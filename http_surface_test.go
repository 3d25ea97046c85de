package caddysse

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Tests of the subscribe HTTP surface (SPEC S2) on cleartext
// HTTP/1.1 and h2c, with both writers.

var bothWriters = []string{"net_http", "takeover"}

// shortTimeoutsGlobals: every Caddy server timeout short (1 s).
const shortTimeoutsGlobals = "servers {\n\t\tprotocols h1 h2c\n\t\ttimeouts {\n\t\t\tread_body 1s\n\t\t\tread_header 1s\n\t\t\twrite 1s\n\t\t\tidle 1s\n\t\t}\n\t}"

func surfaceSite(writer, extra string) string {
	return `
:{PORT} {
	sse /events {
		writer ` + writer + `
		channel {query.channels}
		heartbeat 250ms
		` + extra + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// liveFor reads c's heartbeats until d has passed, failing if the stream
// ends meanwhile.
func liveFor(t *testing.T, c *sseClient, d time.Duration) {
	t.Helper()
	until := time.Now().Add(d)
	for time.Now().Before(until) {
		c.comment("heartbeat")
	}
}

// Caddy's server timeouts (read_body, read_header, write, idle, all 1 s)
// must not cut a stream: it lives for 4 s and still gets an event, on
// HTTP/1.1 and h2c, with both writers (SPEC S2).
func TestServerTimeoutsDoNotCutStreams(t *testing.T) {
	for _, writer := range bothWriters {
		for _, proto := range []string{"h1", "h2c"} {
			t.Run(writer+"/"+proto, func(t *testing.T) {
				srv := startCaddy(t, surfaceSite(writer, ""), shortTimeoutsGlobals)
				var client *http.Client
				if proto == "h2c" {
					client = h2cClient()
				}
				c := openStream(t, srv.base+"/events?channels=a", nil, client)
				if c.resp.StatusCode != 200 {
					t.Fatalf("status %d", c.resp.StatusCode)
				}
				if want := map[string]int{"h1": 1, "h2c": 2}[proto]; c.resp.ProtoMajor != want {
					t.Fatalf("served over %s", c.resp.Proto)
				}
				c.comment("ok")
				liveFor(t, c, 2500*time.Millisecond) // past each 1s timeout twice
				srv.publish("/events", map[string]any{"channel": "a", "data": "late"})
				if ev := c.next(); ev.Data != "late" {
					t.Fatalf("got %+v", ev)
				}
			})
		}
	}
}

// Behind `encode gzip zstd`, a stream (whose response says no-transform)
// is neither compressed nor buffered: the preamble arrives at once,
// without Content-Encoding, then events; with both writers, on HTTP/1.1
// and h2c.
func TestBehindEncode(t *testing.T) {
	for _, writer := range bothWriters {
		for _, proto := range []string{"h1", "h2c"} {
			t.Run(writer+"/"+proto, func(t *testing.T) {
				srv := startCaddy(t, `
:{PORT} {
	encode gzip zstd
	header X-Site yes
	handle_path /api/* {
		sse /events {
			writer `+writer+`
			channel {query.channels}
			publish {
				secret `+testSecret+`
			}
		}
	}
}
`, "servers {\n\t\tprotocols h1 h2c\n\t}")
				client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
				if proto == "h2c" {
					client = h2cClient()
				}
				c := openStream(t, srv.base+"/api/events?channels=a", header("Accept-Encoding", "gzip, zstd"), client)
				if c.resp.StatusCode != 200 {
					t.Fatalf("status %d", c.resp.StatusCode)
				}
				h := c.resp.Header
				if ce := h.Get("Content-Encoding"); ce != "" {
					t.Fatalf("stream compressed: Content-Encoding %q", ce)
				}
				if h.Get("Content-Type") != "text/event-stream" || h.Get("Cache-Control") != "no-store, no-transform" ||
					h.Get("X-Accel-Buffering") != "no" || h.Get("X-Site") != "yes" || h.Get("Content-Length") != "" {
					t.Fatalf("headers %v", h)
				}
				if c.resp.ContentLength != -1 {
					t.Fatalf("ContentLength %d", c.resp.ContentLength)
				}
				c.comment("ok")
				saved := requestClient
				requestClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
				defer func() { requestClient = saved }()
				srv.publish("/api/events", map[string]any{"channel": "a", "data": "x"})
				if ev := c.next(); ev.Data != "x" {
					t.Fatalf("got %+v", ev)
				}
			})
		}
	}
}

// rawRequest sends text on a fresh connection (and runs send, if any, on
// goroutines of their own with it) and returns it with a reader
// positioned after the response head, and the head.
func rawRequest(t *testing.T, addr, text string, send ...func(net.Conn)) (net.Conn, *bufio.Reader, string) {
	t.Helper()
	conn := sendRaw(t, addr, text)
	for _, s := range send { // more of the request, while the answer is read
		go s(conn)
	}
	r := bufio.NewReader(conn)
	var head strings.Builder
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("reading head (%q so far): %v", head.String(), err)
		}
		head.WriteString(line)
		if line == "\r\n" {
			return conn, r, head.String()
		}
	}
}

// sendRaw sends text on a fresh connection, closed when the test ends,
// whose reads and writes fail after waitFor.
func sendRaw(t *testing.T, addr, text string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(waitFor))
	if _, err := io.WriteString(conn, text); err != nil {
		t.Fatal(err)
	}
	return conn
}

// readUntil reads lines from r until one contains want.
func readRawUntil(t *testing.T, r *bufio.Reader, want string) {
	t.Helper()
	var seen strings.Builder
	for {
		line, err := r.ReadString('\n')
		seen.WriteString(line)
		if err != nil {
			t.Fatalf("waiting for %q: %v; read %q", want, err, seen.String())
		}
		if strings.Contains(line, want) {
			return
		}
	}
}

// A GET may carry a body (small, large, chunked),
// or be followed by pipelined requests on the same connection: the stream
// opens, lives and gets events, with both writers.
func TestGetWithBodyAndPipelining(t *testing.T) {
	big := strings.Repeat("b", 256<<10)
	cases := []struct{ name, req string }{
		{"small body", "GET /events?channels=a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"},
		{"large body", "GET /events?channels=a HTTP/1.1\r\nHost: x\r\nContent-Length: " + itoa(len(big)) + "\r\n\r\n" + big},
		{"chunked body", "GET /events?channels=a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"},
		{"pipelined", "GET /events?channels=a HTTP/1.1\r\nHost: x\r\n\r\nGET /events?channels=a HTTP/1.1\r\nHost: x\r\n\r\n"},
		{"connection close", "GET /events?channels=a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"},
		{"http/1.0", "GET /events?channels=a HTTP/1.0\r\nHost: x\r\n\r\n"},
	}
	for _, writer := range bothWriters {
		t.Run(writer, func(t *testing.T) {
			srv := startCaddy(t, surfaceSite(writer, ""))
			addr := "127.0.0.1:" + itoa(srv.port)
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					_, r, head := rawRequest(t, addr, tc.req)
					if !strings.Contains(head, " 200 ") || !strings.Contains(head, "text/event-stream") {
						t.Fatalf("head %q", head)
					}
					readRawUntil(t, r, ": ok")
					readRawUntil(t, r, ": heartbeat")
					readRawUntil(t, r, ": heartbeat")
					data := fmt.Sprintf("%s-%d", strings.ReplaceAll(tc.name, " ", "-"), time.Now().UnixNano())
					srv.publish("/events", map[string]any{"channel": "a", "data": data})
					readRawUntil(t, r, "data: "+data)
				})
			}
		})
	}
}

// HEAD answers the stream's status and headers and no body, with both
// writers, on HTTP/1.1 and h2c; the connection is usable afterwards.
func TestHead(t *testing.T) {
	for _, writer := range bothWriters {
		t.Run(writer, func(t *testing.T) {
			srv := startCaddy(t, surfaceSite(writer, ""), "servers {\n\t\tprotocols h1 h2c\n\t}")
			addr := "127.0.0.1:" + itoa(srv.port)
			// HTTP/1.1: two HEADs then a GET on one connection
			conn, r, head := rawRequest(t, addr, "HEAD /events?channels=a HTTP/1.1\r\nHost: x\r\n\r\n")
			if !strings.Contains(head, " 200 ") || !strings.Contains(head, "Content-Type: text/event-stream") ||
				!strings.Contains(head, "X-Accel-Buffering: no") || !strings.Contains(head, "no-store, no-transform") {
				t.Fatalf("HEAD head %q", head)
			}
			if strings.Contains(head, "Content-Length") {
				t.Errorf("HEAD of a stream announces a Content-Length: %q", head)
			}
			fmt.Fprintf(conn, "HEAD /events HTTP/1.1\r\nHost: x\r\n\r\n")
			var second strings.Builder
			for {
				line, err := r.ReadString('\n')
				if err != nil {
					t.Fatalf("second HEAD on the same connection: %v (after %q)", err, second.String())
				}
				second.WriteString(line)
				if line == "\r\n" {
					break
				}
			}
			if !strings.Contains(second.String(), " 403 ") {
				t.Fatalf("second HEAD: %q", second.String())
			}
			fmt.Fprintf(conn, "GET /events?channels=a HTTP/1.1\r\nHost: x\r\n\r\n")
			readRawUntil(t, r, " 200 ")
			readRawUntil(t, r, ": ok")
			// h2c
			req, _ := http.NewRequest(http.MethodHead, srv.base+"/events?channels=a", nil)
			resp, err := h2cClient().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.ProtoMajor != 2 || resp.StatusCode != 200 || len(body) != 0 || resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("h2c HEAD: %s %d %q %v", resp.Proto, resp.StatusCode, body, resp.Header)
			}
		})
	}
}

// h2Raw is a bare HTTP/2 (h2c, prior knowledge) client connection whose
// flow control the test drives: it gives back connection-level window for
// all it receives, and stream-level window only for the streams it reads.
type h2Raw struct {
	t      *testing.T
	conn   net.Conn
	fr     *http2.Framer
	enc    *hpack.Encoder
	encBuf bytes.Buffer
	nextID uint32
	mu     sync.Mutex // the framer's writes
}

// h2Frame is what a test keeps of a frame the server sent.
type h2Frame struct {
	kind   string
	stream uint32
	data   string
	code   http2.ErrCode
}

func dialH2Raw(t *testing.T, addr string, initialWindow uint32) *h2Raw {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	c := &h2Raw{t: t, conn: conn, fr: http2.NewFramer(conn, conn), nextID: 1}
	c.enc = hpack.NewEncoder(&c.encBuf)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := c.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: initialWindow}); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteWindowUpdate(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	return c
}

// write runs f, which writes frames, alone.
func (c *h2Raw) write(f func(fr *http2.Framer) error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = f(c.fr)
}

func (c *h2Raw) get(path string) uint32 {
	c.t.Helper()
	return c.getHeaders(path)
}

// getHeaders opens a GET stream of path with extra header fields.
func (c *h2Raw) getHeaders(path string, extra ...[2]string) uint32 {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	id := c.nextID
	c.nextID += 2
	c.encBuf.Reset()
	fields := append([][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", "x"}, {":path", path}}, extra...)
	for _, kv := range fields {
		_ = c.enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.encBuf.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		c.t.Fatal(err)
	}
	return id
}

// A stalled HTTP/2 stream (its client gives it no flow-control window)
// does not hold up another stream on the same connection, and is ended
// after slow_client_timeout with a reset of that stream alone: the
// connection is not closed (no GOAWAY) and the other stream goes on. The
// stalled client is throttled. Its queue overflows (the default bounds),
// or holds every event while its write blocks on the window until it is
// cut.
func TestStalledH2StreamOnSharedConnection(t *testing.T) {
	t.Run("its queue overflows", func(t *testing.T) { testStalledH2Stream(t, "") })
	t.Run("its write blocks", func(t *testing.T) {
		testStalledH2Stream(t, "queue 100000\n\t\tqueue_bytes 256MiB\n\t\thistory_bytes 256MiB\n\t\tmax_event_size 16KiB")
	})
}

func testStalledH2Stream(t *testing.T, bounds string) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		`+bounds+`
		slow_client_timeout 1s
		throttle 30s
		heartbeat 5s
		publish {
			secret `+testSecret+`
		}
	}
}
`, "servers {\n\t\tprotocols h1 h2c\n\t}")
	c := dialH2Raw(t, "127.0.0.1:"+itoa(srv.port), 16<<10)
	stalled := c.get("/events?channels=a")
	healthy := c.get("/events?channels=a")

	frames := make(chan h2Frame, 100000)
	go func() {
		defer close(frames)
		for {
			f, err := c.fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.DataFrame:
				n := uint32(len(f.Data()))
				if n > 0 {
					c.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, n) })
					if f.StreamID == healthy {
						c.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(f.StreamID, n) })
					}
				}
				frames <- h2Frame{kind: "data", stream: f.StreamID, data: string(f.Data())}
			case *http2.MetaHeadersFrame:
				frames <- h2Frame{kind: "headers", stream: f.StreamID, data: f.PseudoValue("status")}
			case *http2.RSTStreamFrame:
				frames <- h2Frame{kind: "rst", stream: f.StreamID, code: f.ErrCode}
			case *http2.GoAwayFrame:
				frames <- h2Frame{kind: "goaway", stream: f.LastStreamID, code: f.ErrCode}
			case *http2.SettingsFrame:
				if !f.IsAck() {
					c.write(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
				}
			case *http2.PingFrame:
				if !f.IsAck() {
					c.write(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
				}
			}
		}
	}()
	// both streams open with their preamble
	opened := map[uint32]bool{}
	deadline := time.After(waitFor)
	for len(opened) < 2 {
		select {
		case f, ok := <-frames:
			if !ok {
				t.Fatal("connection closed while opening")
			}
			if f.kind == "data" && strings.Contains(f.data, ": ok") {
				opened[f.stream] = true
			}
		case <-deadline:
			t.Fatalf("streams not opened: %v", opened)
		}
	}
	// large events fill the stalled stream's window; the healthy stream
	// gets every one of them as it is published
	payload := strings.Repeat("p", 8<<10)
	var healthyBuf strings.Builder
	rstAt := time.Time{}
	began := time.Now()
	for i := 0; rstAt.IsZero(); i++ {
		if time.Since(began) > 3*waitFor {
			t.Fatalf("stalled stream not reset after %d events", i)
		}
		marker := fmt.Sprintf("ev-%d-", i)
		srv.publish("/events", map[string]any{"channel": "a", "data": marker + payload})
		wait := time.After(waitFor)
		for !strings.Contains(healthyBuf.String(), "data: "+marker) {
			select {
			case f, ok := <-frames:
				if !ok {
					t.Fatalf("the connection was closed (after %d events)", i)
				}
				switch {
				case f.kind == "goaway":
					t.Fatalf("GOAWAY %v after %d events: the whole connection is ended", f.code, i)
				case f.kind == "rst" && f.stream == healthy:
					t.Fatalf("the healthy stream was reset (%v) after %d events", f.code, i)
				case f.kind == "rst" && f.stream == stalled:
					if rstAt.IsZero() {
						rstAt = time.Now()
						t.Logf("stalled stream reset (%v) after %d events, %s", f.code, i, rstAt.Sub(began).Round(time.Millisecond))
					}
				case f.kind == "data" && f.stream == healthy:
					healthyBuf.WriteString(f.data)
				}
			case <-wait:
				t.Fatalf("the healthy stream did not get event %d within the deadline (stalled stream holding it up?)", i)
			}
		}
		s := healthyBuf.String()
		healthyBuf.Reset()
		healthyBuf.WriteString(s[strings.LastIndex(s, "data: "+marker):])
	}
	if took := rstAt.Sub(began); took > 5*time.Second {
		t.Errorf("stalled stream reset %s after the stall began, want about slow_client_timeout (1s)", took)
	}
	// the connection and the healthy stream live on
	srv.publish("/events", map[string]any{"channel": "a", "data": "after-reset"})
	wait := time.After(waitFor)
	for !strings.Contains(healthyBuf.String(), "data: after-reset") {
		select {
		case f, ok := <-frames:
			if !ok || f.kind == "goaway" || (f.kind == "rst" && f.stream == healthy) {
				t.Fatalf("after the reset: %+v (ok %v)", f, ok)
			}
			if f.kind == "data" && f.stream == healthy {
				healthyBuf.WriteString(f.data)
			}
		case <-wait:
			t.Fatal("the healthy stream got nothing after the stalled one was reset")
		}
	}
	// the stalled client was slow: it is throttled once its end is counted
	// (the reset reaches the client before that)
	eventually(t, "the slow client's end to be counted", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total") >= 1
	})
	assertError(t, do(t, http.MethodGet, srv.base+"/events?channels=a", nil, ""), 429, "throttled")
	if dropped := metric(t, srv.scrape(), "caddy_sse_events_dropped_total"); bounds != "" && dropped != 0 {
		t.Fatalf("%v events dropped: the queue overflowed, the blocked write was not what ended the stream", dropped)
	}
}

// More streams than the server's MaxConcurrentStreams on one HTTP/2
// connection: those beyond are refused (REFUSED_STREAM) without ending the
// connection; streams the client resets end on the server at once, so that
// as many new streams open in their place (net/http queues a stream whose
// handler slot is still held by a handler that has not returned) and get
// events.
func TestManyH2StreamsOnOneConnection(t *testing.T) {
	srv := startCaddy(t, surfaceSite("net_http", ""), "servers {\n\t\tprotocols h1 h2c\n\t}")
	c := dialH2Raw(t, "127.0.0.1:"+itoa(srv.port), 1<<20)
	frames := make(chan h2Frame, 100000)
	var maxStreams uint32
	settings := make(chan struct{})
	go func() {
		defer close(frames)
		first := true
		for {
			f, err := c.fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.DataFrame:
				if n := uint32(len(f.Data())); n > 0 {
					c.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, n) })
					c.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(f.StreamID, n) })
				}
				frames <- h2Frame{kind: "data", stream: f.StreamID, data: string(f.Data())}
			case *http2.RSTStreamFrame:
				frames <- h2Frame{kind: "rst", stream: f.StreamID, code: f.ErrCode}
			case *http2.GoAwayFrame:
				frames <- h2Frame{kind: "goaway", code: f.ErrCode}
			case *http2.SettingsFrame:
				if !f.IsAck() {
					if v, ok := f.Value(http2.SettingMaxConcurrentStreams); ok {
						maxStreams = v
					}
					c.write(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
					if first {
						first = false
						close(settings)
					}
				}
			case *http2.PingFrame:
				if !f.IsAck() {
					c.write(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
				}
			}
		}
	}()
	select {
	case <-settings:
	case <-time.After(waitFor):
		t.Fatal("no SETTINGS from the server")
	}
	if maxStreams == 0 || maxStreams > 1000 {
		t.Skipf("server MaxConcurrentStreams %d", maxStreams)
	}
	total := int(maxStreams) + 10
	var ids []uint32
	for range total {
		ids = append(ids, c.get("/events?channels=a"))
	}
	opened, refused := map[uint32]bool{}, map[uint32]bool{}
	deadline := time.After(3 * waitFor)
	for len(opened)+len(refused) < total {
		select {
		case f, ok := <-frames:
			switch {
			case !ok:
				t.Fatalf("connection closed after %d opened, %d refused", len(opened), len(refused))
			case f.kind == "goaway":
				t.Fatalf("GOAWAY %v after %d opened, %d refused", f.code, len(opened), len(refused))
			case f.kind == "rst":
				refused[f.stream] = true
			case f.kind == "data" && strings.Contains(f.data, ": ok"):
				opened[f.stream] = true
			}
		case <-deadline:
			t.Fatalf("%d of %d streams opened, %d refused", len(opened), total, len(refused))
		}
	}
	t.Logf("max %d: %d opened, %d refused", maxStreams, len(opened), len(refused))
	if len(opened) != int(maxStreams) {
		t.Errorf("%d streams opened, want %d", len(opened), maxStreams)
	}
	// the client resets 20 streams and opens 20 new ones in their place,
	// again and again: their handlers must have returned for them to start
	var reset []uint32
	for _, id := range ids {
		if opened[id] && len(reset) < 20 {
			reset = append(reset, id)
		}
	}
	for round := range 5 {
		for _, id := range reset {
			c.write(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeCancel) })
			delete(opened, id)
		}
		reset = reset[:0]
		for range 20 {
			reset = append(reset, c.get("/events?channels=a"))
		}
		fresh := 0
		deadline := time.After(waitFor)
		for fresh < 20 {
			select {
			case f, ok := <-frames:
				switch {
				case !ok || f.kind == "goaway":
					t.Fatalf("round %d: connection ended (%+v)", round, f)
				case f.kind == "rst":
					t.Fatalf("round %d: new stream %d refused (%v): the reset streams' handlers still hold their slots", round, f.stream, f.code)
				case f.kind == "data" && strings.Contains(f.data, ": ok"):
					opened[f.stream] = true
					fresh++
				}
			case <-deadline:
				t.Fatalf("round %d: %d of 20 new streams opened in place of reset ones", round, fresh)
			}
		}
	}
	// every open stream gets an event
	srv.publish("/events", map[string]any{"channel": "a", "data": "to-all"})
	got := map[uint32]bool{}
	deadline = time.After(waitFor)
	for len(got) < len(opened) {
		select {
		case f, ok := <-frames:
			if !ok || f.kind == "goaway" {
				t.Fatalf("connection ended (%+v)", f)
			}
			if f.kind == "data" && strings.Contains(f.data, "data: to-all") {
				got[f.stream] = true
			}
		case <-deadline:
			t.Fatalf("%d of %d streams got the event", len(got), len(opened))
		}
	}
}

// manyChannelNames returns n channel names of 29 bytes, as a site naming
// them tenant, project and topic would have.
func manyChannelNames(n int) string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("tenant-42:project-%03d:updates", i)
	}
	return strings.Join(names, ",")
}

// A browser's EventSource reconnects with the URL it opened (here, every
// channel) and a Last-Event-ID naming them all. A stream whose reconnect
// would exceed the server's max_header_size opened and then had its
// reconnect refused with 431, which EventSource takes as final: it never
// came back. It is refused when it opens now (400 too_many_channels,
// naming max_header_size), where its developer sees it; with a larger
// max_header_size it opens and its reconnect works. HTTP/2 counts a
// header list more strictly (32 bytes per field) than HTTP/1.1 (4 KiB of
// slack), so fewer channels fit there.
func TestAStreamWhoseReconnectWouldNotFitIsRefusedAtOnce(t *testing.T) {
	site := `
:{PORT} {
	sse /events {
		channel {query.channels}
		max_channels 423
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	tooMany := "/events?channels=" + manyChannelNames(423)
	srv := startCaddy(t, site, h2cGlobals)
	resp := do(t, http.MethodGet, srv.base+tooMany, nil, "")
	if resp.StatusCode == http.StatusOK {
		resp.Body.Close()
		t.Fatal("a stream whose reconnect cannot fit max_header_size opened")
	}
	body := new(strings.Builder)
	_, _ = io.Copy(body, resp.Body)
	resp.Body = io.NopCloser(strings.NewReader(body.String()))
	assertError(t, resp, http.StatusBadRequest, "too_many_channels")
	if !strings.Contains(body.String(), "max_header_size") {
		t.Fatalf("the refusal does not say what to raise: %s", body)
	}

	// 300 fit HTTP/1.1 with room for the reconnect, but not HTTP/2
	fitsH1 := "/events?channels=" + manyChannelNames(300)
	c := openStream(t, srv.base+fitsH1, nil, nil)
	if c.resp.StatusCode != http.StatusOK {
		t.Fatalf("300 channels on HTTP/1.1: %d", c.resp.StatusCode)
	}
	c.comment("ok")
	req, _ := http.NewRequest(http.MethodGet, srv.base+fitsH1, nil)
	h2resp, err := h2cClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if h2resp.ProtoMajor != 2 {
		t.Fatalf("served over %s", h2resp.Proto)
	}
	assertError(t, h2resp, http.StatusBadRequest, "too_many_channels")

	// with room for them, the 423 open, and their reconnect is let in
	big := startCaddy(t, site, "servers {\n\t\tmax_header_size 64KiB\n\t}")
	s := openStream(t, big.base+tooMany, nil, nil)
	if s.resp.StatusCode != http.StatusOK {
		t.Fatalf("423 channels with max_header_size 64KiB: %d", s.resp.StatusCode)
	}
	s.comment("ok")
	// an event on every channel: each has a position (an epoch, a
	// sequence, a time) in the id, as a stream that has lived a while does
	big.publish("/events", map[string]any{"channel": strings.Split(manyChannelNames(423), ","), "data": "x"})
	var id string
	for range 423 {
		id = s.next().ID
	}
	again := openStream(t, big.base+tooMany, http.Header{"Last-Event-Id": {id}}, nil)
	if again.resp.StatusCode != http.StatusOK {
		t.Fatalf("the reconnect with the stream's own id: %d", again.resp.StatusCode)
	}
	// and that reconnect is what the default limit would have refused
	srv = startCaddy(t, site) // one config per process: this replaces big
	resp = do(t, http.MethodGet, srv.base+tooMany, http.Header{"Last-Event-Id": {id}}, "")
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("the reconnect under the default max_header_size: %d, want 431 (the test's premise)", resp.StatusCode)
	}
}

// README, "With other handlers and proxies": channel templates see the
// request as the handlers before sse left it — the path as rewritten, a
// variable set by vars, a value mapped by map.
func TestChannelTemplatesSeeRewritesVarsAndMaps(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	rewrite /feed/* /events/{http.request.uri.path.1}
	vars tenant acme
	map {query.topic} {topic} {
		bills invoices
		default other
	}
	sse /events/* {
		channel {vars.tenant}:{http.request.uri.path.1}:{topic}
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	c := srv.subscribe("/feed/wallet?topic=bills", nil)
	c.comment("ok")
	srv.publish("/events/x", map[string]any{"channel": "acme:wallet:invoices", "data": "through the rewrite"})
	if ev := c.next(); ev.Data != "through the rewrite" {
		t.Fatalf("got %+v", ev)
	}
}
