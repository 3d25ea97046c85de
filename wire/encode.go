// Package wire writes the Server-Sent Events wire format of the WHATWG HTML
// standard: LF line endings only, one "data:" line per line of the payload,
// "event:", "id:" and "retry:" fields, and ":" comment lines.
//
// The functions append to a caller's buffer so that the hot paths can reuse
// buffers and allocate nothing per subscriber.
package wire

import (
	"strconv"
	"unicode/utf8"
)

// MaxEventTypeLen bounds an event type; EventSource has no limit, but a type
// is a short name and a long one is a sign of misuse.
const MaxEventTypeLen = 200

// AppendEvent appends the "event:" line (if typ is not empty) and the
// "data:" lines of an event to dst, without an "id:" line and without the
// blank line that dispatches the event. Every CR, LF and CRLF in data is a
// line break, so data can never inject a field: "a\rid: 9" becomes two
// "data:" lines. Empty data is a single "data:" line.
//
// typ must be valid (see ValidEventType); it is not checked here.
func AppendEvent(dst []byte, typ string, data []byte) []byte {
	if typ != "" {
		dst = append(dst, "event: "...)
		dst = append(dst, typ...)
		dst = append(dst, '\n')
	}
	start := 0
	for i := 0; i < len(data); i++ {
		c := data[i]
		if c != '\r' && c != '\n' {
			continue
		}
		dst = appendDataLine(dst, data[start:i])
		if c == '\r' && i+1 < len(data) && data[i+1] == '\n' {
			i++
		}
		start = i + 1
	}
	return appendDataLine(dst, data[start:])
}

func appendDataLine(dst, line []byte) []byte {
	dst = append(dst, "data: "...)
	dst = append(dst, line...)
	return append(dst, '\n')
}

// AppendID appends an "id:" line followed by the blank line that dispatches
// the event. id must not contain CR, LF or NUL (the ids this module makes are
// base64url).
func AppendID(dst []byte, id []byte) []byte {
	dst = append(dst, "id: "...)
	dst = append(dst, id...)
	return append(dst, '\n', '\n')
}

// AppendEnd appends the blank line that dispatches an event without an id,
// as used by the module's own events (server_closing, sse_truncated, ...) so
// that they never move a client's Last-Event-ID.
func AppendEnd(dst []byte) []byte {
	return append(dst, '\n')
}

// AppendRetry appends a "retry:" line telling the client how many
// milliseconds to wait before reconnecting.
func AppendRetry(dst []byte, ms int64) []byte {
	if ms < 0 {
		ms = 0
	}
	dst = append(dst, "retry: "...)
	dst = strconv.AppendInt(dst, ms, 10)
	return append(dst, '\n')
}

// AppendComment appends a comment line (": text"). Line breaks in text are
// replaced by spaces so a comment stays one line.
func AppendComment(dst []byte, text string) []byte {
	dst = append(dst, ':')
	if text != "" {
		dst = append(dst, ' ')
		for i := 0; i < len(text); i++ {
			c := text[i]
			if c == '\r' || c == '\n' {
				c = ' '
			}
			dst = append(dst, c)
		}
	}
	return append(dst, '\n')
}

// ValidEventType reports whether typ can be sent as an event type: valid
// UTF-8 without CR, LF or NUL, at most MaxEventTypeLen bytes. The empty
// type is valid (EventSource then dispatches a "message" event).
func ValidEventType(typ string) bool {
	if len(typ) > MaxEventTypeLen || !utf8.ValidString(typ) {
		return false
	}
	for i := 0; i < len(typ); i++ {
		switch typ[i] {
		case '\r', '\n', 0:
			return false
		}
	}
	return true
}

// Reserved event types are sent only by the module itself; publishers may not
// use them.
const (
	TypeServerClosing = "server_closing"
	TypeTruncated     = "sse_truncated"
	TypeRejected      = "sse_rejected"
	TypeDegraded      = "sse_degraded"
)

// IsReservedType reports whether typ is one of the module's own event types.
func IsReservedType(typ string) bool {
	switch typ {
	case TypeServerClosing, TypeTruncated, TypeRejected, TypeDegraded:
		return true
	}
	return false
}
