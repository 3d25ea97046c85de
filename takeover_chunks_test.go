package caddysse

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http/httputil"
	"strings"
	"testing"
	"time"
)

// recordingSink keeps every send of a connWriter, and fails them with err.
type recordingSink struct {
	sends [][]byte
	err   error
}

func (rs *recordingSink) writeBy(p []byte, _ time.Time) error {
	rs.sends = append(rs.sends, bytes.Clone(p))
	return rs.err
}

// A taken-over stream's goroutine writes a catch-up (a page of history, up
// to history_bytes for each of its channels) before it flushes: its writer
// sends it in chunks of bounded size as it comes, instead of holding the
// whole page, and the chunks make the same body.
func TestConnWriterSendsALongCatchUpInBoundedChunks(t *testing.T) {
	rs := &recordingSink{}
	cw := &connWriter{to: rs, timeout: time.Second}
	var want strings.Builder
	event := "id: x\ndata: " + strings.Repeat("a", 1000) + "\n\n"
	for range 1000 {
		want.WriteString(event)
		if err := cw.Write([]byte(event)); err != nil {
			t.Fatal(err)
		}
	}
	if len(rs.sends) == 0 {
		t.Fatalf("1 MB written and nothing sent before the flush")
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	limit := connChunkSize + len(event) + 16 // a chunk, the event that filled it, its framing
	var body []byte
	for i, send := range rs.sends {
		if len(send) > limit {
			t.Fatalf("send %d is %d bytes (bound %d)", i, len(send), limit)
		}
		body = append(body, send...)
	}
	got, err := io.ReadAll(httputil.NewChunkedReader(bufio.NewReader(bytes.NewReader(append(body, lastChunk...)))))
	if err != nil {
		t.Fatalf("the sends are no chunked body: %v", err)
	}
	if string(got) != want.String() {
		t.Fatalf("the chunks carry %d bytes, %d were written", len(got), want.Len())
	}
	if cap(cw.body) > connKeptBuffer || cap(cw.framed) > connKeptBuffer {
		t.Fatalf("the writer keeps %d and %d bytes of buffer after the catch-up", cap(cw.body), cap(cw.framed))
	}
}

// A send that fails while a catch-up is written fails the write that
// filled the chunk: the stream ends there, as on net/http.
func TestConnWriterWriteReportsAFailedSend(t *testing.T) {
	rs := &recordingSink{err: errSlowWrite}
	cw := &connWriter{to: rs, timeout: time.Second}
	var err error
	for i := 0; err == nil && i < 100; i++ {
		err = cw.Write(make([]byte, 1000))
	}
	if !errors.Is(err, errSlowWrite) {
		t.Fatalf("writes to a failing sink: %v", err)
	}
}

// What a connWriter sends before its first chunk (what the loop's socket
// had not taken) goes out first, once.
func TestConnWriterSendsWhatWasFramedFirst(t *testing.T) {
	rs := &recordingSink{}
	cw := &connWriter{to: rs, timeout: time.Second, framed: []byte("5\r\nhello\r\n")}
	if err := cw.Write([]byte("world")); err != nil {
		t.Fatal(err)
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := string(bytes.Join(rs.sends, nil)); got != "5\r\nhello\r\n5\r\nworld\r\n" {
		t.Fatalf("sent %q", got)
	}
}
