package wire

import (
	"strings"
	"testing"
)

func TestAppendEvent(t *testing.T) {
	tests := []struct {
		name string
		typ  string
		data string
		want string
	}{
		{"plain", "", "hello", "data: hello\n"},
		{"with type", "update", "hello", "event: update\ndata: hello\n"},
		{"empty data is one data line", "", "", "data: \n"},
		{"empty data with type", "ping", "", "event: ping\ndata: \n"},
		{"LF splits lines", "", "a\nb", "data: a\ndata: b\n"},
		{"CR splits lines", "", "a\rb", "data: a\ndata: b\n"},
		{"CRLF is one break", "", "a\r\nb", "data: a\ndata: b\n"},
		// "\r\r\n" is a CR followed by a CRLF: two breaks, one empty line between.
		{"CR then CRLF", "", "a\r\r\nb", "data: a\ndata: \ndata: b\n"},
		{"LF then CR is two breaks", "", "a\n\rb", "data: a\ndata: \ndata: b\n"},
		{"trailing LF gives empty last line", "", "a\n", "data: a\ndata: \n"},
		{"trailing CR gives empty last line", "", "a\r", "data: a\ndata: \n"},
		{"trailing CRLF gives empty last line", "", "a\r\n", "data: a\ndata: \n"},
		{"only a break", "", "\n", "data: \ndata: \n"},
		{"leading spaces kept", "", "  two\n three", "data:   two\ndata:  three\n"},
		{"colon in data", "", ": not a comment", "data: : not a comment\n"},
		{
			"injection stays in data",
			"", "a\rid: 9\revent: x",
			"data: a\ndata: id: 9\ndata: event: x\n",
		},
		{
			"injection with blank line stays in data",
			"", "a\n\nevent: x\ndata: y",
			"data: a\ndata: \ndata: event: x\ndata: data: y\n",
		},
		{"utf-8 passes through", "t", "héllo ☃", "event: t\ndata: héllo ☃\n"},
		{"NUL passes through", "", "a\x00b", "data: a\x00b\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := string(AppendEvent(nil, tt.typ, []byte(tt.data)))
			if got != tt.want {
				t.Errorf("AppendEvent(%q, %q) = %q, want %q", tt.typ, tt.data, got, tt.want)
			}
		})
	}
}

// The hot paths append to a reused buffer; what is already there must stay.
func TestAppendEventAppendsToDst(t *testing.T) {
	dst := []byte("prefix|")
	got := string(AppendEvent(dst, "t", []byte("x")))
	if want := "prefix|event: t\ndata: x\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// The frame is shared by every subscriber, so encoding into a buffer with
// room must not allocate.
func TestAppendEventDoesNotAllocateWithRoom(t *testing.T) {
	buf := make([]byte, 0, 256)
	data := []byte("line one\r\nline two\nline three")
	allocs := testing.AllocsPerRun(100, func() {
		buf = AppendEvent(buf[:0], "update", data)
		buf = AppendID(buf, []byte("AQID"))
	})
	if allocs != 0 {
		t.Errorf("AppendEvent+AppendID allocated %v times per run, want 0", allocs)
	}
}

func TestAppendID(t *testing.T) {
	got := string(AppendID([]byte("data: x\n"), []byte("AbC-_9")))
	if want := "data: x\nid: AbC-_9\n\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestAppendEnd(t *testing.T) {
	got := string(AppendEnd([]byte("data: x\n")))
	if want := "data: x\n\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestAppendRetry(t *testing.T) {
	tests := []struct {
		ms   int64
		want string
	}{
		{0, "retry: 0\n"},
		{3000, "retry: 3000\n"},
		{9223372036854775807, "retry: 9223372036854775807\n"},
		// A negative delay would be ignored by EventSource (digits only);
		// zero is the nearest meaningful value.
		{-1, "retry: 0\n"},
		{-9223372036854775808, "retry: 0\n"},
	}
	for _, tt := range tests {
		if got := string(AppendRetry(nil, tt.ms)); got != tt.want {
			t.Errorf("AppendRetry(%d) = %q, want %q", tt.ms, got, tt.want)
		}
	}
}

func TestAppendComment(t *testing.T) {
	tests := []struct {
		text string
		want string
	}{
		{"", ":\n"},
		{"heartbeat", ": heartbeat\n"},
		{"a\nb", ": a b\n"},
		{"a\rb", ": a b\n"},
		// Each byte of a CRLF becomes a space: the comment only has to stay
		// one line, not keep the text's shape.
		{"a\r\nb", ": a  b\n"},
		{"\n", ":  \n"},
		{"connection closed: slow client", ": connection closed: slow client\n"},
		{"x\ndata: injected", ": x data: injected\n"},
	}
	for _, tt := range tests {
		got := string(AppendComment(nil, tt.text))
		if got != tt.want {
			t.Errorf("AppendComment(%q) = %q, want %q", tt.text, got, tt.want)
		}
		if strings.Count(got, "\n") != 1 || strings.Contains(got, "\r") {
			t.Errorf("AppendComment(%q) = %q is not exactly one line", tt.text, got)
		}
	}
}

func TestValidEventType(t *testing.T) {
	tests := []struct {
		name string
		typ  string
		want bool
	}{
		{"empty means message", "", true},
		{"simple", "update", true},
		{"spaces and colons", " a: b ", true},
		{"utf-8", "ünïcødé☃", true},
		{"longest", strings.Repeat("a", MaxEventTypeLen), true},
		{"longest in multibyte runes", strings.Repeat("é", MaxEventTypeLen/2), true},
		{"too long", strings.Repeat("a", MaxEventTypeLen+1), false},
		{"too long in multibyte runes", strings.Repeat("é", MaxEventTypeLen/2) + "a", false},
		{"LF", "a\nb", false},
		{"CR", "a\rb", false},
		{"CRLF", "a\r\n", false},
		{"leading LF", "\nx", false},
		{"NUL", "a\x00b", false},
		{"invalid utf-8", "a\xffb", false},
		{"truncated utf-8", "\xc3", false},
		{"surrogate half", "\xed\xa0\x80", false},
		{"overlong encoding", "\xc0\xaf", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ValidEventType(tt.typ); got != tt.want {
				t.Errorf("ValidEventType(%q) = %v, want %v", tt.typ, got, tt.want)
			}
		})
	}
}

func TestIsReservedType(t *testing.T) {
	for _, typ := range []string{"server_closing", "sse_truncated", "sse_rejected", "sse_degraded"} {
		if !IsReservedType(typ) {
			t.Errorf("IsReservedType(%q) = false, want true", typ)
		}
	}
	for _, typ := range []string{"", "message", "update", "SSE_TRUNCATED", "sse_truncated ", " server_closing", "sse_"} {
		if IsReservedType(typ) {
			t.Errorf("IsReservedType(%q) = true, want false", typ)
		}
	}
}

// The constants are part of the contract (SPEC S3): clients match on them.
func TestReservedTypeNames(t *testing.T) {
	got := []string{TypeServerClosing, TypeTruncated, TypeRejected, TypeDegraded}
	want := []string{"server_closing", "sse_truncated", "sse_rejected", "sse_degraded"}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("reserved type %d = %q, want %q", i, got[i], want[i])
		}
		if !ValidEventType(got[i]) {
			t.Errorf("reserved type %q is not a valid event type", got[i])
		}
	}
}
