package wire

import (
	"bytes"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// This file checks the encoder against an independent reading of the
// stream: parseSSE follows the WHATWG HTML "Server-Sent Events" event stream
// interpretation algorithm step by step, so a round trip through it is what
// a browser's EventSource would see. It works on bytes rather than decoded
// text, which is equivalent for valid UTF-8 and lets the fuzzer also feed
// invalid UTF-8 data (the encoder is byte-transparent).

// parsedEvent is one dispatched MessageEvent: its type, data and
// lastEventId.
type parsedEvent struct {
	Type, Data, ID string
}

// parsedStream is everything a client learns from a stream.
type parsedStream struct {
	Events   []parsedEvent
	Comments []string // what follows the ":" of each comment line
	Retry    int64    // the last valid reconnection time, or -1
	LastID   string   // the event source's last event ID string at the end
}

// parseSSE interprets a complete stream. An unterminated last line is
// discarded, as is an event that is not followed by a blank line.
func parseSSE(stream []byte) parsedStream {
	p := parsedStream{Retry: -1}
	var data, typ []byte
	var idBuf string
	stream = bytes.TrimPrefix(stream, []byte("\xEF\xBB\xBF")) // one leading BOM

	for {
		// A line ends at CRLF, LF or CR.
		i := bytes.IndexAny(stream, "\r\n")
		if i < 0 {
			break // incomplete line: discarded
		}
		line := stream[:i]
		if stream[i] == '\r' && i+1 < len(stream) && stream[i+1] == '\n' {
			stream = stream[i+2:]
		} else {
			stream = stream[i+1:]
		}

		switch {
		case len(line) == 0:
			// Dispatch.
			p.LastID = idBuf
			if len(data) == 0 {
				data, typ = data[:0], typ[:0]
				continue
			}
			if data[len(data)-1] == '\n' {
				data = data[:len(data)-1]
			}
			ev := parsedEvent{Type: "message", Data: string(data), ID: p.LastID}
			if len(typ) > 0 {
				ev.Type = string(typ)
			}
			p.Events = append(p.Events, ev)
			data, typ = data[:0], typ[:0]
		case line[0] == ':':
			p.Comments = append(p.Comments, string(line[1:]))
		default:
			field, value := line, []byte(nil)
			if j := bytes.IndexByte(line, ':'); j >= 0 {
				field, value = line[:j], line[j+1:]
				value = bytes.TrimPrefix(value, []byte(" ")) // one space only
			}
			switch string(field) {
			case "event":
				typ = append(typ[:0], value...)
			case "data":
				data = append(data, value...)
				data = append(data, '\n')
			case "id":
				if bytes.IndexByte(value, 0) < 0 {
					idBuf = string(value)
				}
			case "retry":
				if allDigits(value) {
					if ms, err := strconv.ParseInt(string(value), 10, 64); err == nil {
						p.Retry = ms
					}
				}
			}
			// Any other field is ignored.
		}
	}
	return p
}

func allDigits(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// normalizeBreaks is what EventSource gives back for data: every CRLF and
// lone CR becomes LF.
func normalizeBreaks(data []byte) string {
	s := strings.ReplaceAll(string(data), "\r\n", "\n")
	return strings.ReplaceAll(s, "\r", "\n")
}

// The reference parser is only worth something if it reads the examples of
// the standard the way the standard says.
func TestParseSSEFollowsTheStandard(t *testing.T) {
	tests := []struct {
		name   string
		stream string
		want   []parsedEvent
	}{
		{
			"multi-line data",
			"data: YHOO\ndata: +2\ndata: 10\n\n",
			[]parsedEvent{{"message", "YHOO\n+2\n10", ""}},
		},
		{
			"ids persist and an empty id resets",
			": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n\n",
			[]parsedEvent{{"message", "first event", "1"}, {"message", "second event", ""}, {"message", " third event", ""}},
		},
		{
			"bare data fields and an unterminated event",
			"data\n\ndata\ndata\n\ndata:",
			[]parsedEvent{{"message", "", ""}, {"message", "\n", ""}},
		},
		{
			"one optional space",
			"data:test\n\ndata: test\n\n",
			[]parsedEvent{{"message", "test", ""}, {"message", "test", ""}},
		},
		{
			"CR and CRLF line ends",
			"event: a\rdata: x\r\ndata: y\r\r\n",
			[]parsedEvent{{"a", "x\ny", ""}},
		},
		{
			"event without data is not dispatched and its type is reset",
			"event: lost\n\ndata: y\n\n",
			[]parsedEvent{{"message", "y", ""}},
		},
		{
			"id with NUL is ignored",
			"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n",
			[]parsedEvent{{"message", "a", "1"}, {"message", "b", "1"}},
		},
		{
			"unknown fields ignored",
			"foo: bar\ndata: a\n\n",
			[]parsedEvent{{"message", "a", ""}},
		},
		{
			"leading BOM",
			"\xEF\xBB\xBFdata: a\n\n",
			[]parsedEvent{{"message", "a", ""}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parseSSE([]byte(tt.stream)).Events
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("parseSSE(%q) = %+v, want %+v", tt.stream, got, tt.want)
			}
		})
	}
}

func TestParseSSERetry(t *testing.T) {
	tests := []struct {
		stream string
		want   int64
	}{
		{"retry: 1500\n", 1500},
		{"retry: 1500\nretry: 10x\n", 1500},
		{"retry: -5\n", -1},
		{"retry:\n", -1},
		{"retry: 1\nretry: 2\n", 2},
	}
	for _, tt := range tests {
		if got := parseSSE([]byte(tt.stream)).Retry; got != tt.want {
			t.Errorf("parseSSE(%q).Retry = %d, want %d", tt.stream, got, tt.want)
		}
	}
}

// FuzzEncodeRoundTrip checks that one encoded event reads back as exactly
// that event: same type, same id, and the data with its line breaks
// normalized; nothing in the data can add a field or a second event.
func FuzzEncodeRoundTrip(f *testing.F) {
	f.Add("", []byte("hello"), "AQID")
	f.Add("update", []byte(""), "")
	f.Add("t", []byte("a\rid: 9\revent: x"), "x")
	f.Add("t", []byte("a\r\r\nb\n"), "id")
	f.Add("", []byte("\n\n\n"), "1")
	f.Add("", []byte("\r"), "1")
	f.Add("", []byte("\r\n"), "1")
	f.Add(" lead", []byte("  spaced\n  lines "), " spaced id")
	f.Add("a:b", []byte(":comment?\n:\ndata: x"), "")
	f.Add("sse_truncated", []byte(`{"channels": ["a"]}`), "AbC-_9")
	f.Add("ünï", []byte("héllo\x00☃\xff"), "é")
	f.Add("message", []byte("\n\ndata: x\n\n"), "\xEF\xBB\xBF")

	f.Fuzz(func(t *testing.T, typ string, data []byte, id string) {
		if !ValidEventType(typ) || strings.ContainsAny(id, "\r\n\x00") {
			t.Skip()
		}
		stream := AppendID(AppendEvent(nil, typ, data), []byte(id))
		if bytes.IndexByte(stream, '\r') >= 0 {
			t.Fatalf("stream %q has a CR: only LF line ends may be written", stream)
		}

		got := parseSSE(stream)
		want := parsedEvent{Type: typ, Data: normalizeBreaks(data), ID: id}
		if typ == "" {
			want.Type = "message"
		}
		if len(got.Events) != 1 || got.Events[0] != want {
			t.Fatalf("stream %q reads as %+v, want exactly %+v", stream, got.Events, want)
		}
		if len(got.Comments) != 0 || got.Retry != -1 {
			t.Fatalf("stream %q has comments %q or retry %d", stream, got.Comments, got.Retry)
		}
	})
}

// FuzzEncodeStream checks a whole stream as the module writes it: a comment
// and a retry line first, then events, some with an id and some ended
// without one (the module's own events), with heartbeat comments between
// them. Every event must read back in order; an event without an id keeps
// the previous one as lastEventId (it must not move the client's
// Last-Event-ID).
//
// types are split at NUL, datas at 0xFF and ids at ",", one part per event;
// bit i of noID ends event i without an id.
func FuzzEncodeStream(f *testing.F) {
	f.Add("a\x00b\x00", []byte("one\xfftwo\r\nlines\xff"), "i1,i2,i3", "hello", int64(3000), uint16(0))
	f.Add("server_closing", []byte(`{"reason":"reload"}`), "", "ok", int64(-1), uint16(1))
	f.Add("\x00\x00", []byte("\xff\r\xff\n"), "x", "multi\nline\rcomment", int64(0), uint16(0b010))
	f.Add("t", []byte("a\rid: 9\r\rretry: 1\r\n\r\nevent: x\xffdata: y\n\n"), "1,2", "", int64(1<<62), uint16(0b10))
	f.Add("", []byte(""), "", "\r\n", int64(15000), uint16(0xffff))

	f.Fuzz(func(t *testing.T, types string, datas []byte, ids string, comment string, retry int64, noID uint16) {
		typeParts := strings.Split(types, "\x00")
		dataParts := bytes.Split(datas, []byte{0xff})
		idParts := strings.Split(ids, ",")
		n := min(max(len(typeParts), len(dataParts)), 16)
		for _, typ := range typeParts {
			if !ValidEventType(typ) {
				t.Skip()
			}
		}
		if strings.ContainsAny(ids, "\r\n\x00") {
			t.Skip()
		}

		stream := AppendComment(nil, comment)
		stream = AppendRetry(stream, retry)
		wantComments := []string{expectedComment(comment)}
		var want []parsedEvent
		lastID := ""
		for i := range n {
			var typ string
			var data []byte
			if i < len(typeParts) {
				typ = typeParts[i]
			}
			if i < len(dataParts) {
				data = dataParts[i]
			}
			stream = AppendEvent(stream, typ, data)
			if noID&(1<<i) != 0 {
				stream = AppendEnd(stream)
			} else {
				lastID = idParts[i%len(idParts)]
				stream = AppendID(stream, []byte(lastID))
			}
			if i%2 == 1 {
				stream = AppendComment(stream, "heartbeat")
				wantComments = append(wantComments, " heartbeat")
			}
			ev := parsedEvent{Type: typ, Data: normalizeBreaks(data), ID: lastID}
			if typ == "" {
				ev.Type = "message"
			}
			want = append(want, ev)
		}

		got := parseSSE(stream)
		if !reflect.DeepEqual(got.Events, want) {
			t.Fatalf("stream %q reads as\n%+v\nwant\n%+v", stream, got.Events, want)
		}
		if !reflect.DeepEqual(got.Comments, wantComments) {
			t.Fatalf("stream %q has comments %q, want %q", stream, got.Comments, wantComments)
		}
		if wantRetry := max(retry, 0); got.Retry != wantRetry {
			t.Fatalf("stream %q has retry %d, want %d", stream, got.Retry, wantRetry)
		}
		if got.LastID != lastID {
			t.Fatalf("stream %q ends with last event id %q, want %q", stream, got.LastID, lastID)
		}
	})
}

// expectedComment is what the parser reports after the ":" of a comment
// written by AppendComment.
func expectedComment(text string) string {
	if text == "" {
		return ""
	}
	return " " + strings.NewReplacer("\r", " ", "\n", " ").Replace(text)
}
