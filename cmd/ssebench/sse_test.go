package main

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

type gotEvent struct{ typ, data, id string }

// parseAll feeds input to a new parser in the given pieces and returns the
// events, the final retry and the comment count.
func parseAll(t *testing.T, pieces ...string) ([]gotEvent, *sseParser) {
	t.Helper()
	var got []gotEvent
	p := newSSEParser(func(typ, data, id []byte) {
		got = append(got, gotEvent{string(typ), string(data), string(id)})
	})
	for _, piece := range pieces {
		if err := p.Feed([]byte(piece)); err != nil {
			t.Fatalf("Feed(%q): %v", piece, err)
		}
	}
	return got, &p
}

func TestSSEParser(t *testing.T) {
	cases := []struct {
		name     string
		in       string
		want     []gotEvent
		retry    int64
		comments int64
		lastID   string
	}{
		{"module stream", ": ok\nretry: 3000\n\nevent: tick\ndata: {\"a\":1}\nid: X1\n\n", []gotEvent{{"tick", `{"a":1}`, "X1"}}, 3000, 1, "X1"},
		{"no space after colon", "data:x\n\n", []gotEvent{{"", "x", ""}}, -1, 0, ""},
		{"only the first space is dropped", "data:  x\n\n", []gotEvent{{"", " x", ""}}, -1, 0, ""},
		{"multi-line data", "data: a\ndata: b\n\n", []gotEvent{{"", "a\nb", ""}}, -1, 0, ""},
		{"CRLF", "event: e\r\ndata: a\r\nid: 7\r\n\r\n", []gotEvent{{"e", "a", "7"}}, -1, 0, "7"},
		{"CR", "event: e\rdata: a\rid: 7\r\r", []gotEvent{{"e", "a", "7"}}, -1, 0, "7"},
		{"empty data line dispatches", "data\n\n", []gotEvent{{"", "", ""}}, -1, 0, ""},
		{"no data: nothing dispatched, id kept", "id: 5\n\n", nil, -1, 0, "5"},
		{"id persists to later events", "id: 5\ndata: a\n\ndata: b\n\n", []gotEvent{{"", "a", "5"}, {"", "b", "5"}}, -1, 0, "5"},
		{"id with NUL ignored", "id: 1\n\nid: a\x00b\ndata: x\n\n", []gotEvent{{"", "x", "1"}}, -1, 0, "1"},
		{"empty id resets", "id: 1\n\nid\ndata: x\n\n", []gotEvent{{"", "x", ""}}, -1, 0, ""},
		{"bad retry ignored", "retry: 12a\nretry: 50\nretry: x\n\n", nil, 50, 0, ""},
		{"comments", ": heartbeat\n: connection closed: slow client\n", nil, -1, 2, ""},
		{"unknown field", "foo: bar\ndata: x\n\n", []gotEvent{{"", "x", ""}}, -1, 0, ""},
		{"type reset after dispatch", "event: a\ndata: 1\n\ndata: 2\n\n", []gotEvent{{"a", "1", ""}, {"", "2", ""}}, -1, 0, ""},
		{"type without data is dropped", "event: a\n\ndata: 2\n\n", []gotEvent{{"", "2", ""}}, -1, 0, ""},
		{"server closing", "retry: 1234\nevent: server_closing\ndata: {\"reason\":\"reload\"}\n\n", []gotEvent{{"server_closing", `{"reason":"reload"}`, ""}}, 1234, 0, ""},
		{"incomplete event not dispatched", "data: a\n", nil, -1, 0, ""},
		{"leading BOM stripped", "\xEF\xBB\xBFdata: x\n\n", []gotEvent{{"", "x", ""}}, -1, 0, ""},
		{"only one BOM stripped", "\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\ndata: y\n\n", []gotEvent{{"", "y", ""}}, -1, 0, ""},
		{"BOM prefix is data", "\xEF\xBBdata: x\n\ndata: y\n\n", []gotEvent{{"", "y", ""}}, -1, 0, ""},
		{"BOM only at the start", "data: x\n\n\xEF\xBB\xBFdata: y\n\n", []gotEvent{{"", "x", ""}}, -1, 0, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// whole, then split at every position, then byte by byte
			splits := [][]string{{tc.in}}
			for i := 1; i < len(tc.in); i++ {
				splits = append(splits, []string{tc.in[:i], tc.in[i:]})
			}
			splits = append(splits, strings.Split(tc.in, ""))
			for _, pieces := range splits {
				got, p := parseAll(t, pieces...)
				if !reflect.DeepEqual(got, tc.want) {
					t.Fatalf("pieces %q: events %q, want %q", pieces, got, tc.want)
				}
				if p.retry != tc.retry || p.comments != tc.comments || string(p.lastID) != tc.lastID {
					t.Fatalf("pieces %q: retry %d comments %d lastID %q, want %d %d %q", pieces, p.retry, p.comments, p.lastID, tc.retry, tc.comments, tc.lastID)
				}
			}
		})
	}
}

// An empty Feed (the epoll engine feeds whatever the chunk decoder returns,
// which is empty for a read holding only chunk framing) must not forget
// that the previous piece ended with a CR: the LF that follows belongs to
// the same CRLF line ending. Otherwise "data: a\r" + "" + "\ndata: b\r\n\r\n"
// is dispatched as two events instead of one.
func TestSSEParserEmptyFeedKeepsCR(t *testing.T) {
	got, _ := parseAll(t, "data: a\r", "", "\ndata: b\r\n\r\n")
	want := []gotEvent{{"", "a\nb", ""}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("events %q, want %q (an empty Feed dropped the pending CR)", got, want)
	}
}

// TestSSEParserReset checks what a new stream keeps of the last one: the
// last event ID and the retry, but neither the incomplete event nor a
// pending CR; and its BOM is stripped again.
func TestSSEParserReset(t *testing.T) {
	for _, cut := range []string{
		"event: x\ndata: partial\nid: 9\ndata: {\"c\":0,\"s\":2",
		"data: partial\r",
		"\xEF\xBB",
	} {
		var got []gotEvent
		p := newSSEParser(func(typ, data, id []byte) {
			got = append(got, gotEvent{string(typ), string(data), string(id)})
		})
		for _, piece := range []string{"retry: 70\nid: 1\ndata: a\n\n", cut, "", "\xEF\xBB\xBF\ndata: b\n\n"} {
			if piece == "" {
				p.reset() // the next stream
				continue
			}
			if err := p.Feed([]byte(piece)); err != nil {
				t.Fatal(err)
			}
		}
		want := []gotEvent{{"", "a", "1"}, {"", "b", "1"}}
		if !reflect.DeepEqual(got, want) || p.retry != 70 || string(p.lastID) != "1" {
			t.Fatalf("cut %q: events %q retry %d lastID %q, want %q, 70 and \"1\"", cut, got, p.retry, p.lastID, want)
		}
	}
}

func TestSSEParserLineLimit(t *testing.T) {
	p := newSSEParser(nil)
	p.maxLine = 10
	if err := p.Feed([]byte("data: 0123456789")); err != errLineTooLong {
		t.Fatalf("long partial line: %v, want errLineTooLong", err)
	}
	p = newSSEParser(nil)
	p.maxLine = 10
	if err := p.Feed([]byte("data: 01234\ndata: 56789\n")); err != errLineTooLong {
		t.Fatalf("long data buffer: %v, want errLineTooLong", err)
	}
}

func TestSSEParserAllocs(t *testing.T) {
	p := newSSEParser(func(typ, data, id []byte) {})
	frame := []byte("event: tick\ndata: {\"c\":1,\"s\":2,\"t\":3}\nid: AX1V8avv0-iDCQHPwaDGojQH\n\n")
	_ = p.Feed(frame) // grow the buffers
	if n := testing.AllocsPerRun(100, func() { _ = p.Feed(frame) }); n != 0 {
		t.Fatalf("Feed allocates %v times per event, want 0", n)
	}
}

// chunk encodes body as HTTP/1.1 chunks of the given sizes, with an
// extension on the first and a trailer.
func chunk(body string, sizes ...int) string {
	var b strings.Builder
	first := true
	for len(body) > 0 {
		n := len(body)
		if len(sizes) > 0 {
			n = min(sizes[0], n)
			sizes = sizes[1:]
		}
		fmt.Fprintf(&b, "%x", n)
		if first {
			b.WriteString(";ext=1")
			first = false
		}
		b.WriteString("\r\n" + body[:n] + "\r\n")
		body = body[n:]
	}
	b.WriteString("0\r\nX-Trailer: y\r\n\r\n")
	return b.String()
}

func TestChunkDecoder(t *testing.T) {
	body := ": ok\nretry: 3000\n\nevent: tick\ndata: hello\nid: 1\n\n"
	enc := chunk(body, 5, 17, 1, 30)
	for i := 0; i <= len(enc); i++ {
		for j := i; j <= len(enc); j += 7 {
			var d chunkDecoder
			var out []byte
			done := false
			for _, piece := range []string{enc[:i], enc[i:j], enc[j:]} {
				buf := []byte(piece)
				got, fin, err := d.Decode(buf)
				if err != nil {
					t.Fatalf("split %d/%d: %v", i, j, err)
				}
				out = append(out, got...)
				done = fin
			}
			if string(out) != body || !done {
				t.Fatalf("split %d/%d: got %q done=%v, want %q done", i, j, out, done, body)
			}
		}
	}
	// bytes after the end are ignored
	var d chunkDecoder
	got, done, err := d.Decode([]byte("3\r\nabc\r\n0\r\n\r\nGARBAGE"))
	if err != nil || !done || string(got) != "abc" {
		t.Fatalf("got %q %v %v", got, done, err)
	}
	// LF-only framing is accepted
	d = chunkDecoder{}
	got, done, err = d.Decode([]byte("3\nabc\n0\n\n"))
	if err != nil || !done || string(got) != "abc" {
		t.Fatalf("LF framing: got %q %v %v", got, done, err)
	}
	for _, bad := range []string{"x\r\n", "3\r\nabcX", "\r\n", "3\rX", "0\r\n\rX", "fffffffffffffffff\r\n"} {
		d := chunkDecoder{}
		if _, _, err := d.Decode([]byte(bad)); err == nil {
			t.Errorf("Decode(%q): no error", bad)
		}
	}
}

func TestParseResponseHead(t *testing.T) {
	in := "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-Replay-Truncated: true\r\n\r\nrest"
	n := headEnd([]byte(in))
	if n != len(in)-4 {
		t.Fatalf("headEnd = %d, want %d", n, len(in)-4)
	}
	h, err := parseResponseHead([]byte(in[:n]))
	if err != nil || h.status != 200 || !h.chunked || !h.truncated || h.contentLength != -1 {
		t.Fatalf("got %+v, %v", h, err)
	}
	h, err = parseResponseHead([]byte("HTTP/1.1 503 Service Unavailable\nContent-Length: 27\nconnection: Close\n\n"))
	if err != nil || h.status != 503 || h.chunked || h.contentLength != 27 || !h.closeConn {
		t.Fatalf("got %+v, %v", h, err)
	}
	if headEnd([]byte("HTTP/1.1 200 OK\r\nA: b\r\n")) != -1 {
		t.Fatal("headEnd found an end in an incomplete head")
	}
	for _, bad := range []string{"", "HTTP/2 200\r\n\r\n", "HTTP/1.1 2x0 OK\r\n\r\n", "HTTP/1.1 200 OK\r\nnocolon\r\n\r\n", "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"} {
		if _, err := parseResponseHead([]byte(bad)); err == nil {
			t.Errorf("parseResponseHead(%q): no error", bad)
		}
	}
}

func TestBenchData(t *testing.T) {
	for _, pad := range []int{0, 1, 100} {
		ev := benchEvent{ch: 999, seq: 123456, t: 1795980546773336627}
		b := appendBenchData(nil, ev, pad)
		got, ok := parseBenchData(b)
		if !ok || got != ev {
			t.Fatalf("pad %d: %s parsed as %+v %v", pad, b, got, ok)
		}
	}
	// a JSON re-encoder may reorder and space fields
	got, ok := parseBenchData([]byte(`{"t": 9223372036854775807, "x":"q", "s" :2,"c":0}`))
	if !ok || got != (benchEvent{ch: 0, seq: 2, t: 9223372036854775807}) {
		t.Fatalf("got %+v %v", got, ok)
	}
	for _, bad := range []string{`{"c":1,"s":2}`, `{"c":1,"s":2,"t":-3}`, `hello`, `{"c":1,"s":2,"t":99999999999999999999}`, ``} {
		if _, ok := parseBenchData([]byte(bad)); ok {
			t.Errorf("parseBenchData(%q) ok", bad)
		}
	}
}

func TestParseDigits(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "42": 42, "9223372036854775807": 1<<63 - 1} {
		if n, ok := parseDigits([]byte(in)); !ok || n != want {
			t.Errorf("parseDigits(%q) = %d %v", in, n, ok)
		}
	}
	for _, in := range []string{"", "-1", "1a", "9223372036854775808", "99999999999999999999"} {
		if _, ok := parseDigits([]byte(in)); ok {
			t.Errorf("parseDigits(%q) ok", in)
		}
	}
}

// The parser must agree with itself on random streams cut at random places.
func TestSSEParserRandomSplits(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var stream bytes.Buffer
	var want []gotEvent
	for i := range 200 {
		nl := []string{"\n", "\r\n", "\r"}[rng.IntN(3)]
		ev := gotEvent{typ: fmt.Sprintf("t%d", i%3), data: fmt.Sprintf("line%d%sline2", i, "\n"), id: fmt.Sprint(i)}
		fmt.Fprintf(&stream, ": c%s", nl)
		fmt.Fprintf(&stream, "event: %s%sdata: line%d%sdata: line2%sid: %d%s%s", ev.typ, nl, i, nl, nl, i, nl, nl)
		want = append(want, ev)
	}
	in := stream.String()
	for range 50 {
		var pieces []string
		rest := in
		for len(rest) > 0 {
			n := min(1+rng.IntN(40), len(rest))
			pieces = append(pieces, rest[:n])
			rest = rest[n:]
		}
		got, _ := parseAll(t, pieces...)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("random split: got %d events, want %d", len(got), len(want))
		}
	}
}
