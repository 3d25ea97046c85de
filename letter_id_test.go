package caddysse

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// letterLastEventID is a client's Last-Event-ID after it read body, under
// the letter of the WHATWG standard: the last event ID buffer starts empty
// on each connection, and every blank line sets the last event ID string to
// it, whether or not an event is dispatched. prev is the id it came with. A
// line not ended by a LF is not read yet.
func letterLastEventID(prev, body string) string {
	last, buf := prev, ""
	lines := strings.Split(body, "\n")
	for _, line := range lines[:len(lines)-1] {
		field, value, _ := strings.Cut(line, ":")
		switch {
		case line == "":
			last = buf
		case field == "id" && !strings.ContainsRune(value, 0):
			buf = strings.TrimPrefix(value, " ")
		}
	}
	return last
}

// readBodyUntil reads resp's body until it holds want (failing the test at
// waitFor), and returns what it read.
func readBodyUntil(t *testing.T, resp *http.Response, want string) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		var b strings.Builder
		r := bufio.NewReader(resp.Body)
		for !strings.Contains(b.String(), want) {
			line, err := r.ReadString('\n')
			b.WriteString(line)
			if err != nil {
				break
			}
		}
		got <- b.String()
	}()
	select {
	case s := <-got:
		if !strings.Contains(s, want) {
			t.Fatalf("the body ended without %q: %q", want, s)
		}
		return s
	case <-time.After(waitFor):
		resp.Body.Close()
		t.Fatalf("no %q within %v", want, waitFor)
	}
	return ""
}

// A client that comes back with a cursor keeps it, under the letter of the
// WHATWG standard too, through every answer that is not a stream that
// writes it an id of its own: what ends such an answer's first block (a
// blank line) sets the client's Last-Event-ID to the connection's last event
// ID buffer, which starts empty — and its next connection would start live
// (losing what was published meanwhile), or replay again from an older
// lastEventID in its URL. So each says the client's cursor back first, if
// it is one: a reconnect to a config on its way out (server_closing at
// once), a refusal in the stream (rejections in_stream), a stream that
// opens degraded (Redis down). Text that is not a cursor is never said
// back (a lastEventID query parameter can hold a newline).
func TestAClientKeepsItsCursorUnderTheLetterOfWHATWG(t *testing.T) {
	cursor := replay.EncodeCursor(replay.ChannelPosition{
		Hash: replay.HashChannel("a"), Pos: replay.Position{Epoch: 7, Seq: 3, Time: time.Now().UnixMilli()}})

	t.Run("config on its way out", func(t *testing.T) {
		startCaddy(t, lifeSite(lifeSSE("/events", ""))) // an active context
		h := &Handler{Channels: []string{"a"}}
		ctx := caddy.ActiveContext()
		ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{})
		if err := h.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		if err := h.Cleanup(); err != nil {
			t.Fatal(err)
		}
		serve := func(target string, hdr http.Header) string {
			rec := httptest.NewRecorder()
			req := httptest.NewRequest(http.MethodGet, target, nil)
			for k, v := range hdr {
				req.Header[k] = v
			}
			req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
			if err := h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })); err != nil {
				t.Fatal(err)
			}
			body := rec.Body.String()
			if rec.Code != http.StatusOK || !strings.Contains(body, "event: server_closing\n") {
				t.Fatalf("%d %q, want 200 and server_closing", rec.Code, body)
			}
			return body
		}
		body := serve("/events", header("Last-Event-ID", cursor))
		if got := letterLastEventID(cursor, body); got != cursor {
			t.Errorf("told to reconnect (%q), the client's Last-Event-ID is %q, want its own %q", body, got, cursor)
		}
		evil := "x\ndata: injected\nid: evil"
		body = serve("/events?lastEventID="+url.QueryEscape(evil), nil)
		if strings.Contains(body, "injected") || strings.Contains(body, "evil") {
			t.Errorf("text that is not a cursor was said back: %q", body)
		}
	})

	t.Run("in-stream refusal", func(t *testing.T) {
		srv := startCaddy(t, strings.ReplaceAll(governedSite, "{MODE}", rejectionsInStream))
		srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
		resp := do(t, http.MethodGet, srv.base+"/events?channels=a&user=u1", header("Last-Event-ID", cursor), "")
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "event: sse_rejected\n") {
			t.Fatalf("%d %q, want 200 and sse_rejected", resp.StatusCode, body)
		}
		if got := letterLastEventID(cursor, string(body)); got != cursor {
			t.Errorf("refused in the stream (%q), the client's Last-Event-ID is %q, want its own %q", body, got, cursor)
		}
	})

	t.Run("degraded", func(t *testing.T) {
		rds := redistest.Start(t)
		rds.Kill()
		srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 1m"))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.base+"/events?channels=a", nil)
		req.Header.Set("Last-Event-ID", cursor)
		resp, err := (&http.Client{Transport: &http.Transport{DisableCompression: true}}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body := readBodyUntil(t, resp, "event: sse_degraded\ndata: {\"channels\":[\"a\"]}\n\n")
		if got := letterLastEventID(cursor, body); got != cursor {
			t.Errorf("opened degraded (%q), the client's Last-Event-ID is %q, want its own %q", body, got, cursor)
		}
	})
}
