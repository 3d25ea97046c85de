package main

import (
	"bytes"
	"errors"
	"math"
	"strconv"
)

// sseParser is an incremental Server-Sent Events parser following the WHATWG
// rules (LF, CRLF and CR line endings, a leading BOM, comments, the last
// event ID buffer, retry). It is fed raw body bytes in pieces of any size
// and calls onEvent for every dispatched event with a non-empty data
// buffer; reset begins a new stream. Nothing it hands out outlives the
// callback. It allocates only while its buffers grow.
type sseParser struct {
	line   []byte // a partial line carried to the next Feed
	data   []byte // the data buffer (lines joined by LF)
	typ    []byte // the event type buffer
	idBuf  []byte // the last event ID buffer
	lastID []byte // the last event ID string, set at dispatch
	// retry is the reconnection time in ms from the last retry: field, or
	// -1 if none was seen.
	retry int64
	// skipLF is set when the previous Feed ended with a CR: a LF at the
	// start of the next one belongs to the same line ending.
	skipLF bool
	// hasData is whether a data: field was seen since the last dispatch.
	hasData bool
	// atStart is set until the first bytes of a stream are parsed: a UTF-8
	// BOM there is stripped (WHATWG). The bytes of a BOM split over Feeds
	// wait in line meanwhile.
	atStart bool
	// comments counts comment lines (heartbeats and notices).
	comments int64
	// maxLine bounds a line (and the data buffer); a longer one is an error.
	maxLine int
	// onEvent receives each dispatched event: its type (empty for
	// "message"), its data and the last event ID string.
	onEvent func(typ, data, id []byte)
}

var errLineTooLong = errors.New("sse: line too long")

func newSSEParser(onEvent func(typ, data, id []byte)) sseParser {
	return sseParser{retry: -1, maxLine: 1 << 20, atStart: true, onEvent: onEvent}
}

// reset readies the parser for a new stream of the same EventSource: what a
// stream cut mid-event left (a partial line, the incomplete event's fields)
// is discarded, as a browser discards it at the end of the stream, instead
// of joining the next stream's first line. The last event ID string and the
// reconnection time outlive the stream, as they do in a browser.
func (p *sseParser) reset() {
	p.line = p.line[:0]
	p.data = p.data[:0]
	p.typ = p.typ[:0]
	p.idBuf = append(p.idBuf[:0], p.lastID...)
	p.hasData = false
	p.skipLF = false
	p.atStart = true
}

// Feed parses p. p is not retained.
func (p *sseParser) Feed(b []byte) error {
	if len(b) == 0 {
		// nothing to parse, and a pending CR must still swallow the LF
		// of the next piece
		return nil
	}
	if p.atStart {
		if b = p.stripBOM(b); len(b) == 0 {
			return nil
		}
	}
	if p.skipLF {
		p.skipLF = false
		if len(b) > 0 && b[0] == '\n' {
			b = b[1:]
		}
	}
	for len(b) > 0 {
		// The common case is LF-only: find the LF, then make sure no CR
		// ends the line earlier.
		end, next := -1, 0
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			end, next = i, i+1
			if j := bytes.IndexByte(b[:i], '\r'); j >= 0 {
				end, next = j, j+1
				if j+1 < len(b) && b[j+1] == '\n' {
					next = j + 2
				}
			}
		} else if j := bytes.IndexByte(b, '\r'); j >= 0 {
			end, next = j, j+1
			if j+1 == len(b) {
				p.skipLF = true
			} else if b[j+1] == '\n' {
				next = j + 2
			}
		}
		if end < 0 {
			if len(p.line)+len(b) > p.maxLine {
				return errLineTooLong
			}
			p.line = append(p.line, b...)
			return nil
		}
		line := b[:end]
		if len(p.line) > 0 {
			if len(p.line)+len(line) > p.maxLine {
				return errLineTooLong
			}
			p.line = append(p.line, line...)
			line = p.line
		}
		err := p.processLine(line)
		p.line = p.line[:0]
		if err != nil {
			return err
		}
		b = b[next:]
	}
	return nil
}

// stripBOM drops a UTF-8 BOM at the start of the stream and clears atStart
// once the stream's first bytes are known to be one or not. The bytes of a
// BOM's prefix are held in line: if they turn out not to be a BOM, they are
// the start of the first line (they hold no line ending).
func (p *sseParser) stripBOM(b []byte) []byte {
	const bom = "\xEF\xBB\xBF"
	for len(b) > 0 {
		n := len(p.line)
		if b[0] != bom[n] {
			p.atStart = false
			return b
		}
		p.line = append(p.line, b[0])
		b = b[1:]
		if n+1 == len(bom) {
			p.line = p.line[:0]
			p.atStart = false
			return b
		}
	}
	return b
}

func (p *sseParser) processLine(line []byte) error {
	if len(line) == 0 {
		p.dispatch()
		return nil
	}
	if line[0] == ':' {
		p.comments++
		return nil
	}
	name, value := line, line[len(line):]
	if i := bytes.IndexByte(line, ':'); i >= 0 {
		name, value = line[:i], line[i+1:]
		if len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
	}
	switch string(name) {
	case "event":
		p.typ = append(p.typ[:0], value...)
	case "data":
		if len(p.data)+len(value) > p.maxLine {
			return errLineTooLong
		}
		p.data = append(p.data, value...)
		p.data = append(p.data, '\n')
		p.hasData = true
	case "id":
		if bytes.IndexByte(value, 0) < 0 {
			p.idBuf = append(p.idBuf[:0], value...)
		}
	case "retry":
		if n, ok := parseDigits(value); ok {
			p.retry = n
		}
	}
	return nil
}

// dispatch follows the standard: the last event ID string is set even if
// the data buffer is empty, then an empty data buffer dispatches nothing.
func (p *sseParser) dispatch() {
	p.lastID = append(p.lastID[:0], p.idBuf...)
	if !p.hasData {
		p.typ = p.typ[:0]
		return
	}
	data := p.data[:len(p.data)-1] // the trailing LF
	if p.onEvent != nil {
		p.onEvent(p.typ, data, p.lastID)
	}
	p.data = p.data[:0]
	p.typ = p.typ[:0]
	p.hasData = false
}

// parseDigits parses a non-empty run of ASCII digits that fits an int64.
func parseDigits(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 19 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + uint64(c-'0')
	}
	if n > math.MaxInt64 || (len(b) == 19 && b[0] > '9') {
		return 0, false
	}
	return int64(n), true
}

// chunkDecoder decodes HTTP/1.1 chunked transfer coding incrementally and in
// place.
type chunkDecoder struct {
	state     int
	remaining int64 // bytes left in the current chunk
	size      int64
	digits    int
	done      bool
}

const (
	chSize = iota
	chExt
	chSizeLF
	chData
	chDataCR
	chDataLF
	chTrailerStart
	chTrailerLine
	chTrailerEndLF
	chDone
)

var errBadChunk = errors.New("http: malformed chunked encoding")

// Decode decodes p in place: it returns the body bytes (which share p's
// memory, moved to its front) and whether the last chunk and trailer were
// read. Bytes after the end are ignored.
func (d *chunkDecoder) Decode(p []byte) (body []byte, done bool, err error) {
	w := 0
	i := 0
	for i < len(p) {
		c := p[i]
		switch d.state {
		case chSize:
			switch {
			case c >= '0' && c <= '9', c >= 'a' && c <= 'f', c >= 'A' && c <= 'F':
				if d.digits >= 15 {
					return p[:w], false, errBadChunk
				}
				d.size = d.size<<4 | int64(unhex(c))
				d.digits++
			case c == ';' || c == ' ' || c == '\t':
				if d.digits == 0 {
					return p[:w], false, errBadChunk
				}
				d.state = chExt
			case c == '\r':
				d.state = chSizeLF
			case c == '\n':
				d.state = chSizeLF
				continue // handled there
			default:
				return p[:w], false, errBadChunk
			}
			i++
		case chExt:
			if c == '\r' {
				d.state = chSizeLF
			} else if c == '\n' {
				d.state = chSizeLF
				continue
			}
			i++
		case chSizeLF:
			if c != '\n' || d.digits == 0 {
				return p[:w], false, errBadChunk
			}
			i++
			d.remaining, d.size, d.digits = d.size, 0, 0
			if d.remaining == 0 {
				d.state = chTrailerStart
			} else {
				d.state = chData
			}
		case chData:
			n := int64(len(p) - i)
			if n > d.remaining {
				n = d.remaining
			}
			w += copy(p[w:], p[i:i+int(n)])
			i += int(n)
			d.remaining -= n
			if d.remaining == 0 {
				d.state = chDataCR
			}
		case chDataCR:
			switch c {
			case '\r':
				d.state = chDataLF
				i++
			case '\n':
				d.state = chDataLF
			default:
				return p[:w], false, errBadChunk
			}
		case chDataLF:
			if c != '\n' {
				return p[:w], false, errBadChunk
			}
			i++
			d.state = chSize
		case chTrailerStart:
			switch c {
			case '\r':
				d.state = chTrailerEndLF
				i++
			case '\n':
				d.state = chTrailerEndLF
			default:
				d.state = chTrailerLine
				i++
			}
		case chTrailerLine:
			if c == '\n' {
				d.state = chTrailerStart
			}
			i++
		case chTrailerEndLF:
			if c != '\n' {
				return p[:w], false, errBadChunk
			}
			d.state = chDone
			d.done = true
			return p[:w], true, nil
		case chDone:
			return p[:w], true, nil
		}
	}
	return p[:w], d.done, nil
}

func unhex(c byte) byte {
	switch {
	case c >= '0' && c <= '9':
		return c - '0'
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10
	default:
		return c - 'A' + 10
	}
}

// responseHead is what the tool needs from an HTTP/1.x response head.
type responseHead struct {
	status        int
	chunked       bool
	contentLength int64 // -1 if absent
	truncated     bool  // X-Replay-Truncated: true
	closeConn     bool
}

var errBadHead = errors.New("http: malformed response head")

// parseResponseHead parses a response head ending with an empty line
// (CRLF or LF line endings), as found by headEnd.
func parseResponseHead(b []byte) (responseHead, error) {
	h := responseHead{contentLength: -1}
	first := true
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			i = len(b)
		}
		line := bytes.TrimRight(b[:i], "\r")
		if i < len(b) {
			b = b[i+1:]
		} else {
			b = nil
		}
		if first {
			first = false
			// HTTP/1.1 200 OK
			if !bytes.HasPrefix(line, []byte("HTTP/1.")) || len(line) < 12 || line[8] != ' ' {
				return h, errBadHead
			}
			n, ok := parseDigits(line[9:12])
			if !ok {
				return h, errBadHead
			}
			h.status = int(n)
			continue
		}
		if len(line) == 0 {
			break
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 {
			return h, errBadHead
		}
		name := line[:colon]
		value := bytes.TrimSpace(line[colon+1:])
		switch {
		case asciiEqualFold(name, "transfer-encoding"):
			if containsTokenFold(value, "chunked") {
				h.chunked = true
			}
		case asciiEqualFold(name, "content-length"):
			n, err := strconv.ParseInt(string(value), 10, 64)
			if err != nil || n < 0 {
				return h, errBadHead
			}
			h.contentLength = n
		case asciiEqualFold(name, "x-replay-truncated"):
			h.truncated = asciiEqualFold(value, "true")
		case asciiEqualFold(name, "connection"):
			h.closeConn = containsTokenFold(value, "close")
		}
	}
	if first {
		return h, errBadHead
	}
	return h, nil
}

// headEnd returns the length of the response head in b including its final
// empty line, or -1 if b does not hold a whole head yet.
func headEnd(b []byte) int {
	if i := bytes.Index(b, []byte("\r\n\r\n")); i >= 0 {
		return i + 4
	}
	if i := bytes.Index(b, []byte("\n\n")); i >= 0 {
		return i + 2
	}
	return -1
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		c, d := b[i], s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if 'A' <= d && d <= 'Z' {
			d += 'a' - 'A'
		}
		if c != d {
			return false
		}
	}
	return true
}

func containsTokenFold(v []byte, token string) bool {
	for _, part := range bytes.Split(v, []byte(",")) {
		if asciiEqualFold(bytes.TrimSpace(part), token) {
			return true
		}
	}
	return false
}

// benchEvent is what the tool publishes: the channel index, the per-channel
// sequence number and the publish time, as compact JSON data.
type benchEvent struct {
	ch  int64
	seq int64
	t   int64 // monoNow at publish (CLOCK_MONOTONIC ns)
}

// appendBenchData appends the JSON data of an event: {"c":1,"s":2,"t":3}
// followed by pad bytes of padding in a "p" field if pad > 0.
func appendBenchData(dst []byte, ev benchEvent, pad int) []byte {
	dst = append(dst, `{"c":`...)
	dst = strconv.AppendInt(dst, ev.ch, 10)
	dst = append(dst, `,"s":`...)
	dst = strconv.AppendInt(dst, ev.seq, 10)
	dst = append(dst, `,"t":`...)
	dst = strconv.AppendInt(dst, ev.t, 10)
	if pad > 0 {
		dst = append(dst, `,"p":"`...)
		for range pad {
			dst = append(dst, 'x')
		}
		dst = append(dst, '"')
	}
	return append(dst, '}')
}

// parseBenchData reads the c, s and t fields of the data of an event the
// tool published. It tolerates any order, spaces and other fields, but not
// nesting of those keys.
func parseBenchData(b []byte) (benchEvent, bool) {
	var ev benchEvent
	var have int
	for i := 0; i+3 < len(b); i++ {
		if b[i] != '"' || b[i+2] != '"' {
			continue
		}
		key := b[i+1]
		if key != 'c' && key != 's' && key != 't' {
			continue
		}
		j := i + 3
		for j < len(b) && (b[j] == ' ' || b[j] == '\t') {
			j++
		}
		if j >= len(b) || b[j] != ':' {
			continue
		}
		j++
		for j < len(b) && (b[j] == ' ' || b[j] == '\t') {
			j++
		}
		k := j
		for k < len(b) && b[k] >= '0' && b[k] <= '9' {
			k++
		}
		n, ok := parseDigits(b[j:k])
		if !ok {
			return ev, false
		}
		switch key {
		case 'c':
			ev.ch, have = n, have|1
		case 's':
			ev.seq, have = n, have|2
		case 't':
			ev.t, have = n, have|4
		}
		i = k - 1
	}
	return ev, have == 7
}
