package caddysse

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/caddy-sse/caddy-sse/internal/freeport"
	"github.com/caddy-sse/caddy-sse/internal/testwriter"
	"github.com/caddy-sse/caddy-sse/replay"
)

// The tests of this package run a real Caddy in-process (one config at a
// time: Caddy's running config is process-wide, so these tests are not
// parallel) on free loopback ports, and talk to it with real HTTP clients.

const testSecret = "test-secret"

// requestClient sends the tests' requests other than streams (publishes,
// refusals). Without keep-alive: a connection kept from before a reload is
// closed by the old server, and a POST sent on it fails instead of being
// retried.
var requestClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// waitFor is the deadline for anything a test waits for.
const waitFor = 10 * time.Second

type testServer struct {
	t     testing.TB
	port  int
	base  string
	base2 string // the second site, when the sites use {PORT2}
}

// freePort returns a port free on every interface (see internal/freeport).
func freePort(t testing.TB) int {
	t.Helper()
	return freeport.Get(t, false)
}

// globalOptions keep tests from touching the admin port, the user's config
// directory and the terminal (set SSE_TEST_LOG=1 to see Caddy's logs). A
// test that needs the admin endpoint passes its own "admin <address>".
func globalOptions(extra string) string {
	logs := "log default {\n\t\toutput discard\n\t}"
	if os.Getenv("SSE_TEST_LOG") != "" {
		logs = "log default {\n\t\tlevel DEBUG\n\t}"
	}
	admin := "admin off"
	if strings.HasPrefix(strings.TrimSpace(extra), "admin ") {
		admin = ""
	}
	return fmt.Sprintf("{\n\t%s\n\tpersist_config off\n\tauto_https off\n\t%s\n\t%s\n}\n", admin, logs, extra)
}

// startCaddy loads a Caddyfile whose site blocks use {PORT} (and {PORT2}
// for a second site) as their port, and stops it when the test ends.
func startCaddy(t testing.TB, sites string, globals ...string) *testServer {
	t.Helper()
	var port, port2 int
	// a port free a moment ago may be taken meanwhile by another test
	// package running in parallel: try again with others
	for attempt := 1; ; attempt++ {
		port, port2 = freePort(t), freePort(t)
		text := strings.ReplaceAll(sites, "{PORT}", strconv.Itoa(port))
		text = strings.ReplaceAll(text, "{PORT2}", strconv.Itoa(port2))
		text = globalOptions(strings.Join(globals, "\n")) + text
		err := caddy.Load(adapt(t, text), true)
		if err == nil {
			break
		}
		if attempt == 5 || !strings.Contains(err.Error(), "address already in use") {
			t.Fatalf("loading config: %v\n%s", err, text)
		}
	}
	t.Cleanup(func() {
		if err := caddy.Stop(); err != nil {
			t.Errorf("stopping caddy: %v", err)
		}
	})
	return &testServer{t: t, port: port,
		base:  fmt.Sprintf("http://127.0.0.1:%d", port),
		base2: fmt.Sprintf("http://127.0.0.1:%d", port2)}
}

func adapt(t testing.TB, caddyfile string) []byte {
	t.Helper()
	caddyfile = testwriter.Apply(caddyfile)
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		t.Fatalf("adapting Caddyfile: %v\n%s", err, caddyfile)
	}
	for _, w := range warnings {
		if !strings.Contains(w.Message, "not formatted") {
			t.Logf("adapt warning: %s", w.String())
		}
	}
	return cfg
}

func loadCaddyfile(t testing.TB, caddyfile string) {
	t.Helper()
	if err := caddy.Load(adapt(t, caddyfile), true); err != nil {
		t.Fatalf("loading config: %v\n%s", err, caddyfile)
	}
}

// reload replaces the running config with sites (same {PORT} as s).
func (s *testServer) reload(sites string, globals ...string) {
	s.t.Helper()
	sites = strings.ReplaceAll(sites, "{PORT}", strconv.Itoa(s.port))
	loadCaddyfile(s.t, globalOptions(strings.Join(globals, "\n"))+sites)
	awaitOldListenerClosed(s.t, s.port)
}

// awaitOldListenerClosed waits until at most one socket listens on port.
// caddy.Load returns once the old server's shutdown has been started, not
// once it closed its listening socket (a socket per config, SO_REUSEPORT):
// until then the kernel may give that socket new connections, which the
// old config answers with server_closing (SPEC S8; tested on purpose by
// TestReplayAcrossReloadReachingTheOldConfig). A test that opens a stream
// after a reload means the new config. Linux only (/proc); elsewhere it
// returns at once.
func awaitOldListenerClosed(t testing.TB, port int) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		n, ok := listeningSockets(port)
		if !ok || n <= 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sockets still listen on port %d after the reload", n, port)
		}
		time.Sleep(time.Millisecond)
	}
}

// listeningSockets counts the TCP sockets listening on port, from
// /proc/net/tcp and tcp6; false where they cannot be read.
func listeningSockets(port int) (int, bool) {
	hexPort := fmt.Sprintf(":%04X", port)
	n, read := 0, false
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		read = true
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) > 3 && strings.HasSuffix(f[1], hexPort) && f[3] == "0A" { // 0A: LISTEN
				n++
			}
		}
	}
	return n, read
}

// publish POSTs a JSON event and returns the ids of the reply.
func (s *testServer) publish(path string, body any) map[string]string {
	s.t.Helper()
	status, reply := s.post(path, "application/json", mustJSON(s.t, body), nil)
	if status != http.StatusOK {
		s.t.Fatalf("publish: status %d: %s", status, reply)
	}
	var out struct {
		IDs map[string]string `json:"ids"`
	}
	if err := json.Unmarshal(reply, &out); err != nil {
		s.t.Fatalf("publish reply %q: %v", reply, err)
	}
	return out.IDs
}

func (s *testServer) post(path, contentType string, body []byte, header http.Header) (int, []byte) {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.base+path, strings.NewReader(string(body)))
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("Authorization", "Bearer "+testSecret)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := doAcrossReloads(requestClient, req)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, reply
}

// doAcrossReloads sends req, trying again (up to five times) when it got
// no response at all: Caddy reloads with SO_REUSEPORT, and a connection
// queued on the old listening socket when it closes is refused or reset
// before its request is read. A backend or an EventSource retries too.
func doAcrossReloads(client *http.Client, req *http.Request) (*http.Response, error) {
	for attempt := 1; ; attempt++ {
		resp, err := client.Do(req)
		if err == nil || attempt == 5 {
			return resp, err
		}
		time.Sleep(50 * time.Millisecond)
		if req.GetBody != nil {
			req.Body, _ = req.GetBody()
		}
	}
}

func (s *testServer) postForm(path string, form url.Values) (int, []byte) {
	s.t.Helper()
	return s.post(path, "application/x-www-form-urlencoded", []byte(form.Encode()), nil)
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sseEvent is an event as an EventSource would dispatch it.
type sseEvent struct {
	Type  string // "message" when the stream named none
	Data  string
	ID    string // the last event id after this event
	OwnID bool   // the event's own block had an id line
	Retry int    // the last retry seen, -1 if none
}

// sseClient is one open stream, parsed by the WHATWG algorithm into events
// (and comment lines, kept apart so heartbeats can be checked).
type sseClient struct {
	t        testing.TB
	resp     *http.Response
	cancel   context.CancelFunc
	events   chan sseEvent
	comments chan string
	done     chan struct{}
	// lastSeenID is the client's Last-Event-ID: the last id field of a
	// block that ended (its blank line read), also one that dispatched no
	// event (id-only), as a browser keeps it
	lastSeenID atomic.Pointer[string]
	// ended says how the body ended (set before events is closed): "the
	// body ended" for a clean end, else the read error (a connection cut
	// inside the chunked body is an unexpected EOF)
	ended string
	lines int // lines read, for the same message
}

// subscribe opens a stream of path with optional headers; it fails the test
// unless the status is 200.
func (s *testServer) subscribe(path string, header http.Header) *sseClient {
	s.t.Helper()
	c := openStream(s.t, s.base+path, header, nil)
	if c.resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(c.resp.Body)
		s.t.Fatalf("subscribe %s: status %d: %s", path, c.resp.StatusCode, body)
	}
	return c
}

func openStream(t testing.TB, url string, header http.Header, client *http.Client) *sseClient {
	t.Helper()
	if client == nil {
		client = &http.Client{Transport: &http.Transport{DisableCompression: true}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := doAcrossReloads(client, req)
	if err != nil {
		cancel()
		t.Fatalf("GET %s: %v", url, err)
	}
	c := &sseClient{t: t, resp: resp, cancel: cancel,
		events: make(chan sseEvent, 10000), comments: make(chan string, 10000), done: make(chan struct{})}
	go c.read()
	t.Cleanup(c.close)
	return c
}

func (c *sseClient) close() {
	c.cancel()
	c.resp.Body.Close()
	<-c.done
}

// read implements the WHATWG "interpret an event stream" algorithm.
func (c *sseClient) read() {
	defer close(c.done)
	defer close(c.events)
	sc := bufio.NewScanner(c.resp.Body)
	defer func() {
		c.ended = "the body ended"
		if err := sc.Err(); err != nil {
			c.ended = err.Error()
		}
		c.ended += " after " + strconv.Itoa(c.lines) + " lines"
	}()
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var typ, lastID string
	idSeen, blockID := false, false
	var data strings.Builder
	hasData := false
	retry := -1
	for sc.Scan() {
		line := sc.Text()
		c.lines++
		switch {
		case line == "":
			if idSeen {
				// a browser's Last-Event-ID moves at dispatch, not at the id
				// line: a stream cut inside a block leaves it where it was
				id := lastID
				c.lastSeenID.Store(&id)
			}
			if hasData {
				ev := sseEvent{Type: typ, Data: strings.TrimSuffix(data.String(), "\n"), ID: lastID, OwnID: blockID, Retry: retry}
				if ev.Type == "" {
					ev.Type = "message"
				}
				c.events <- ev
			}
			typ, hasData, blockID = "", false, false
			data.Reset()
		case strings.HasPrefix(line, ":"):
			select {
			case c.comments <- line:
			default:
			}
		default:
			field, value, _ := strings.Cut(line, ":")
			value = strings.TrimPrefix(value, " ")
			switch field {
			case "event":
				typ = value
			case "data":
				data.WriteString(value)
				data.WriteByte('\n')
				hasData = true
			case "id":
				if !strings.ContainsRune(value, 0) {
					lastID, idSeen, blockID = value, true, true
				}
			case "retry":
				if n, err := strconv.Atoi(value); err == nil {
					retry = n
				}
			}
		}
	}
}

// next returns the next event, failing the test after the deadline or if
// the stream ends.
func (c *sseClient) next() sseEvent {
	c.t.Helper()
	ev, ok := c.nextOrEnd()
	if !ok {
		c.t.Fatalf("stream ended while an event was expected (%s)", c.ended)
	}
	return ev
}

// nextOrEnd returns the next event, or false if the stream ended (c.ended
// says how); it fails the test after the deadline.
func (c *sseClient) nextOrEnd() (sseEvent, bool) {
	c.t.Helper()
	select {
	case ev, ok := <-c.events:
		return ev, ok
	case <-time.After(waitFor):
		c.t.Fatal("no event within the deadline")
	}
	return sseEvent{}, false
}

// nextData returns the data of the next n events.
func (c *sseClient) nextData(n int) []string {
	c.t.Helper()
	out := make([]string, 0, n)
	for range n {
		select {
		case ev, ok := <-c.events:
			if !ok {
				c.t.Fatalf("stream ended after %q while %d events were expected (%s)", out, n, c.ended)
			}
			out = append(out, ev.Data)
		case <-time.After(waitFor):
			c.t.Fatalf("no event within the deadline after %q (%d expected)", out, n)
		}
	}
	return out
}

// expectEnd waits for the stream to end, failing on any further event.
func (c *sseClient) expectEnd() {
	c.t.Helper()
	select {
	case ev, ok := <-c.events:
		if ok {
			c.t.Fatalf("expected the stream to end, got event %+v", ev)
		}
	case <-time.After(waitFor):
		c.t.Fatal("stream did not end within the deadline")
	}
}

// comment waits for a comment line with the given text.
func (c *sseClient) comment(text string) {
	c.t.Helper()
	deadline := time.After(waitFor)
	for {
		select {
		case line := <-c.comments:
			if line == ": "+text || line == ":"+text {
				return
			}
		case <-c.done:
			for {
				select {
				case line := <-c.comments:
					if line == ": "+text || line == ":"+text {
						return
					}
				default:
					c.t.Fatalf("stream ended while waiting for a %q comment", text)
				}
			}
		case <-deadline:
			c.t.Fatalf("no %q comment within the deadline", text)
		}
	}
}

// seqOf decodes the position of the only channel of an id.
func seqOf(t testing.TB, id string) replay.Position {
	t.Helper()
	entries, ok := replay.ParseCursor(id)
	if !ok || len(entries) != 1 {
		t.Fatalf("id %q is not a one-channel cursor", id)
	}
	return entries[0].Pos
}

func header(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h
}

func itoa(n int) string { return strconv.Itoa(n) }
