package e2e

import (
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestSSEParser checks the test client's own parser against the WHATWG
// algorithm, so that the end-to-end tests do not pass or fail by a parser
// mistake.
func TestSSEParser(t *testing.T) {
	in := "\xEF\xBB\xBF: ok\nretry: 3000\n\n" + // preamble: no event
		"data: a\r\ndata:b\rid: 1\n\n" + // CRLF and CR line ends, no space after colon
		": comment\nevent: t\ndata\nretry: x\n\n" + // field without colon; bad retry ignored
		"retry: 150\nevent: server_closing\ndata: {\"reason\":\"reload\"}\n\n" +
		"id\nevent: only-type\n\n" + // no data: nothing dispatched, but the id is reset
		"data: after\n\n" +
		"data: incomplete" // no blank line at the end: dropped
	p := newSSEParser()
	var got []sseEvent
	err := readLines(strings.NewReader(in), func(l string) {
		if ev, _ := p.line(l); ev != nil {
			got = append(got, *ev)
		}
	})
	if err != io.EOF {
		t.Fatalf("readLines: %v", err)
	}
	want := []sseEvent{
		{Type: "message", Data: "a\nb", ID: "1", HasID: true, Retry: -1},
		{Type: "t", Data: "", ID: "1", Retry: -1},
		{Type: "server_closing", Data: `{"reason":"reload"}`, ID: "1", Retry: 150},
		{Type: "message", Data: "after", ID: "", Retry: -1},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parsed\n%v\nwant\n%v", got, want)
	}
	if p.reconnectMS != 150 {
		t.Fatalf("reconnection time %d, want 150", p.reconnectMS)
	}
	if len(p.comments) != 2 || p.comments[0] != " ok" {
		t.Fatalf("comments %q", p.comments)
	}
}

// A reconnection keeps the client's Last-Event-ID through events without
// an id (server_closing before any other event), as EventSource does: the
// test client's parser starts at the id the connection was opened with.
// An empty start made the next reconnect a fresh one, which skipped what
// was published meanwhile (TestReloadToNewRedisSettingsUnderLoadLosesNothing
// failed so once).
func TestSSEConnKeepsItsLastEventIDThroughEventsWithoutOne(t *testing.T) {
	c := openCanned(t, ": ok\nretry: 3000\n\nevent: server_closing\ndata: {\"reason\":\"reload\"}\n\n", "cursor-7")
	ev, err := c.next(time.Now().Add(10 * time.Second))
	if err != nil || ev.Type != "server_closing" {
		t.Fatalf("next: %v %v, want server_closing", ev, err)
	}
	if id := c.lastEventID(); id != "cursor-7" {
		t.Fatalf("after server_closing the last event id is %q, want cursor-7", id)
	}
}

// An id-only block (the module's opening ends with one, giving a stream's
// cursor before its first event) moves the client's Last-Event-ID, as it
// moves an EventSource's, though nothing dispatches: the test client moved
// it on events only, so the end-to-end tests reconnected a stream cut
// before its first event as a fresh one and could not see the opening id.
func TestSSEConnTakesTheIDOfAnIDOnlyBlock(t *testing.T) {
	c := openCanned(t, ": ok\nretry: 3000\nid: opening\n\nevent: server_closing\ndata: {\"reason\":\"reload\"}\n\nid: closing\n\n", "")
	ev, err := c.next(time.Now().Add(10 * time.Second))
	if err != nil || ev.Type != "server_closing" {
		t.Fatalf("next: %v %v, want server_closing", ev, err)
	}
	if id := c.lastEventID(); id != "opening" {
		t.Fatalf("after the opening's id-only block the last event id is %q, want opening", id)
	}
	if err := c.expectEnd(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if id := c.lastEventID(); id != "closing" {
		t.Fatalf("at the end the last event id is %q, want closing", id)
	}
}

// openCanned opens a stream, with lastID as its Last-Event-ID, from a
// server that answers it with body and ends it; the server checks that
// the request came with lastID.
func openCanned(t *testing.T, body, lastID string) *sseConn {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if got := r.Header.Get("Last-Event-ID"); got != lastID {
			t.Errorf("Last-Event-ID %q, want %q", got, lastID)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	c, err := tryOpenStream(srv.Client(), srv.URL, lastID, time.Now().Add(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	return c
}
