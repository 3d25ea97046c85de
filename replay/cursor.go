package replay

import (
	"encoding/base64"
	"encoding/binary"
	"hash/crc32"
	"slices"
	"strings"
)

// A cursor is what a client sends back as Last-Event-ID: the position of
// every channel of its connection, each channel named by a 32-bit hash of
// its full name. The text form is base64url (no padding, so no "," and
// nothing EventSource would mangle) of:
//
//	version (1 byte, cursorVersion)
//	per channel: hash (4 bytes, big endian), epoch, seq, time (unsigned varints)
//	check (1 byte: low byte of the CRC-32 of everything before it)
//
// A channel costs 4+5+1..9+6 bytes, so about 22 to 32 characters. The id a
// publish returns for channel X is the cursor naming X alone, so it is a
// valid Last-Event-ID for any connection that has channel X.
const (
	cursorVersion = 1
	// MaxCursorLen bounds the text of a cursor that is parsed.
	MaxCursorLen = 16 << 10
	// maxEntryLen is the most a channel's entry takes (a hash, a 32-bit
	// epoch and two 64-bit varints).
	maxEntryLen = 4 + 5 + 2*binary.MaxVarintLen64
	// MaxCursorChannels is the most channels a cursor can name and still
	// parse: its text, base64 of the version, the entries and the check
	// byte, must fit in MaxCursorLen. A stream may have no more channels,
	// or its own ids would not be read back.
	MaxCursorChannels = (MaxCursorLen/4*3 - 2) / maxEntryLen
)

// ChannelPosition is one entry of a cursor.
type ChannelPosition struct {
	Hash uint32
	Pos  Position
}

// HashChannel returns the hash that names a channel in cursors (FNV-1a of the
// channel's full name, the same on every instance).
func HashChannel(name string) uint32 {
	const offset32, prime32 = 2166136261, 16777619
	h := uint32(offset32)
	for i := 0; i < len(name); i++ {
		h ^= uint32(name[i])
		h *= prime32
	}
	return h
}

// CursorEncoder encodes cursors into buffers it reuses, so that writing an
// id per event allocates nothing once the buffers have grown.
type CursorEncoder struct {
	raw  []byte
	text []byte
	// of is what text encodes: an event loop lends one encoder to the
	// streams it writes in turn, and those of one channel share the id of
	// each event, so one encoding serves them all
	of []ChannelPosition
}

// Encode returns the text of the cursor made of entries. The returned slice
// is valid until the next call and must not be changed.
func (c *CursorEncoder) Encode(entries []ChannelPosition) []byte {
	if len(c.text) > 0 && slices.Equal(entries, c.of) {
		return c.text
	}
	c.raw = appendRawCursor(c.raw[:0], entries)
	c.text = base64.RawURLEncoding.AppendEncode(c.text[:0], c.raw)
	c.of = append(c.of[:0], entries...)
	return c.text
}

// EncodeCursor returns the text of the cursor made of entries.
func EncodeCursor(entries ...ChannelPosition) string {
	var c CursorEncoder
	return string(c.Encode(entries))
}

func appendRawCursor(dst []byte, entries []ChannelPosition) []byte {
	dst = append(dst, cursorVersion)
	for _, e := range entries {
		dst = binary.BigEndian.AppendUint32(dst, e.Hash)
		dst = binary.AppendUvarint(dst, uint64(e.Pos.Epoch))
		dst = binary.AppendUvarint(dst, e.Pos.Seq)
		dst = binary.AppendUvarint(dst, uint64(e.Pos.Time))
	}
	return append(dst, byte(crc32.ChecksumIEEE(dst)))
}

// ParseCursor decodes a cursor's text. It reports false for anything that is
// not a cursor this package wrote (wrong alphabet, version or check byte,
// truncated or trailing bytes, out-of-range values); it never panics.
func ParseCursor(text string) ([]ChannelPosition, bool) {
	// base64 decoding skips CR and LF; a cursor never holds them
	if len(text) == 0 || len(text) > MaxCursorLen || strings.ContainsAny(text, "\r\n") {
		return nil, false
	}
	raw, err := base64.RawURLEncoding.DecodeString(text)
	if err != nil || len(raw) < 2 || raw[0] != cursorVersion {
		return nil, false
	}
	body, check := raw[:len(raw)-1], raw[len(raw)-1]
	if byte(crc32.ChecksumIEEE(body)) != check {
		return nil, false
	}
	var entries []ChannelPosition
	for rest := body[1:]; len(rest) > 0; {
		e, n := parseEntry(rest)
		if n <= 0 {
			return nil, false
		}
		entries = append(entries, e)
		rest = rest[n:]
	}
	if len(entries) == 0 {
		return nil, false
	}
	return entries, true
}

// parseEntry decodes one entry and returns how many bytes it took, or 0.
func parseEntry(b []byte) (ChannelPosition, int) {
	var e ChannelPosition
	if len(b) < 4 {
		return e, 0
	}
	e.Hash = binary.BigEndian.Uint32(b)
	off := 4
	var vals [3]uint64
	for i := range vals {
		v, n := binary.Uvarint(b[off:])
		if n <= 0 {
			return e, 0
		}
		vals[i] = v
		off += n
	}
	if vals[0] > 0xFFFFFFFF || vals[2] > 1<<62 {
		return e, 0
	}
	e.Pos = Position{Epoch: uint32(vals[0]), Seq: vals[1], Time: int64(vals[2])}
	return e, off
}

// Lookup returns the position the cursor holds for the channel with hash h.
func Lookup(entries []ChannelPosition, h uint32) (Position, bool) {
	for i := len(entries) - 1; i >= 0; i-- { // the last entry wins
		if entries[i].Hash == h {
			return entries[i].Pos, true
		}
	}
	return Position{}, false
}
