package replay

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"hash/crc32"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// realistic values: an epoch anywhere in uint32, a busy channel's seq, and
// a Unix millisecond time in the 2020s.
const (
	realEpoch = math.MaxUint32
	realSeq   = 1_000_000_000
	realTime  = 1_800_000_000_000
)

func entry(name string, epoch uint32, seq uint64, ms int64) ChannelPosition {
	return ChannelPosition{Hash: HashChannel(name), Pos: Position{Epoch: epoch, Seq: seq, Time: ms}}
}

// rawCursor builds the text of a cursor from its raw bytes (version and
// entries), appending a correct check byte, so that tests can craft
// cursors that are wrong in exactly one way.
func rawCursor(body []byte) string {
	raw := append(append([]byte(nil), body...), byte(crc32.ChecksumIEEE(body)))
	return base64.RawURLEncoding.EncodeToString(raw)
}

func TestHashChannelIsFNV1a(t *testing.T) {
	for _, name := range []string{"", "a", "foobar", "orders/42", strings.Repeat("x", 200)} {
		h := fnv.New32a()
		h.Write([]byte(name))
		if got, want := HashChannel(name), h.Sum32(); got != want {
			t.Errorf("HashChannel(%q) = %#x, want FNV-1a %#x", name, got, want)
		}
	}
}

func TestCursorRoundTrip(t *testing.T) {
	tests := []struct {
		name    string
		entries []ChannelPosition
	}{
		{"one channel", []ChannelPosition{entry("a", 7, 42, realTime)}},
		{"zero position", []ChannelPosition{entry("a", 0, 0, 0)}},
		{"realistic maxima", []ChannelPosition{entry("a", realEpoch, realSeq, realTime)}},
		{"largest values", []ChannelPosition{{Hash: math.MaxUint32, Pos: Position{Epoch: math.MaxUint32, Seq: math.MaxUint64, Time: 1 << 62}}}},
		{"several channels", []ChannelPosition{
			entry("a", 1, 1, 1), entry("b", 2, 300, realTime), entry("c", 0, 0, 0),
		}},
		{"same hash twice", []ChannelPosition{entry("a", 1, 1, 1), entry("a", 1, 2, 2)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text := EncodeCursor(tt.entries...)
			got, ok := ParseCursor(text)
			if !ok {
				t.Fatalf("ParseCursor(%q) failed", text)
			}
			if !reflect.DeepEqual(got, tt.entries) {
				t.Errorf("ParseCursor(EncodeCursor(%+v)) = %+v", tt.entries, got)
			}
		})
	}
}

func TestCursorRoundTripRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		entries := make([]ChannelPosition, 1+rng.IntN(8))
		for i := range entries {
			entries[i] = ChannelPosition{Hash: rng.Uint32(), Pos: Position{
				Epoch: rng.Uint32(),
				Seq:   rng.Uint64() >> rng.IntN(64),
				Time:  rng.Int64N(1<<62 + 1),
			}}
		}
		text := EncodeCursor(entries...)
		got, ok := ParseCursor(text)
		if !ok || !reflect.DeepEqual(got, entries) {
			t.Fatalf("round trip of %+v via %q gave %+v, %v", entries, text, got, ok)
		}
	}
}

// A cursor is sent back as Last-Event-ID and may be put in a URL: it must be
// base64url without padding, and must never contain "," (SPEC S4).
func TestCursorTextAlphabet(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 500 {
		entries := make([]ChannelPosition, 1+rng.IntN(5))
		for i := range entries {
			entries[i] = ChannelPosition{Hash: rng.Uint32(), Pos: Position{Epoch: rng.Uint32(), Seq: rng.Uint64N(1 << 40), Time: rng.Int64N(1 << 42)}}
		}
		text := EncodeCursor(entries...)
		for _, c := range text {
			if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				t.Fatalf("cursor %q has %q, outside the unpadded base64url alphabet", text, c)
			}
		}
	}
}

// SPEC S4: at most ~40 bytes per channel, for one channel and for many.
func TestCursorSizePerChannel(t *testing.T) {
	for _, n := range []int{1, 2, 8, 32} {
		entries := make([]ChannelPosition, n)
		for i := range entries {
			entries[i] = ChannelPosition{Hash: math.MaxUint32, Pos: Position{Epoch: realEpoch, Seq: realSeq, Time: realTime}}
		}
		text := EncodeCursor(entries...)
		if len(text) > 40*n {
			t.Errorf("cursor of %d channels is %d bytes, want at most %d", n, len(text), 40*n)
		}
	}
}

// The id written per event comes from a reused encoder: it must give the
// same text as EncodeCursor and allocate nothing once its buffers grew.
func TestCursorEncoderReuse(t *testing.T) {
	small := []ChannelPosition{entry("a", 1, 2, 3)}
	big := make([]ChannelPosition, 32)
	for i := range big {
		big[i] = entry(string(rune('a'+i)), realEpoch, realSeq+uint64(i), realTime)
	}
	var enc CursorEncoder
	for _, entries := range [][]ChannelPosition{big, small, big, small} {
		if got, want := string(enc.Encode(entries)), EncodeCursor(entries...); got != want {
			t.Fatalf("CursorEncoder.Encode = %q, want %q", got, want)
		}
	}
	allocs := testing.AllocsPerRun(100, func() {
		big[0].Pos.Seq++
		enc.Encode(big)
	})
	if allocs != 0 {
		t.Errorf("CursorEncoder.Encode allocated %v times per call after warm-up, want 0", allocs)
	}
}

// An encoder reused by streams in turn keeps the text of the last cursor
// for the next stream with the same positions, and encodes again when any
// part of any position differs, also when the caller changed the entries
// it was given before in place.
func TestCursorEncoderNoticesEveryChange(t *testing.T) {
	entries := []ChannelPosition{entry("a", 1, 2, 3), entry("b", 4, 5, 6)}
	var enc CursorEncoder
	check := func(what string) {
		t.Helper()
		if got, want := string(enc.Encode(entries)), EncodeCursor(entries...); got != want {
			t.Fatalf("%s: Encode = %q, want %q", what, got, want)
		}
	}
	check("first")
	check("the same again")
	entries = slices.Clone(entries)
	check("equal entries in another slice")
	changes := []struct {
		what   string
		change func(e *ChannelPosition)
	}{
		{"seq changed in place", func(e *ChannelPosition) { e.Pos.Seq++ }},
		{"time changed in place", func(e *ChannelPosition) { e.Pos.Time++ }},
		{"epoch changed in place", func(e *ChannelPosition) { e.Pos.Epoch++ }},
		{"channel changed in place", func(e *ChannelPosition) { e.Hash++ }},
	}
	for _, c := range changes {
		c.change(&entries[1])
		check(c.what)
	}
	entries = entries[:1]
	check("one channel fewer")
	entries = append(entries, entry("c", 7, 8, 9))
	check("another channel")
}

func TestLookup(t *testing.T) {
	a, b := HashChannel("a"), HashChannel("b")
	entries := []ChannelPosition{
		{Hash: a, Pos: Position{Epoch: 1, Seq: 1}},
		{Hash: b, Pos: Position{Epoch: 2, Seq: 5}},
		{Hash: a, Pos: Position{Epoch: 1, Seq: 9}},
	}
	if pos, ok := Lookup(entries, a); !ok || pos != (Position{Epoch: 1, Seq: 9}) {
		t.Errorf("Lookup(a) = %+v, %v; want the last entry for a", pos, ok)
	}
	if pos, ok := Lookup(entries, b); !ok || pos != (Position{Epoch: 2, Seq: 5}) {
		t.Errorf("Lookup(b) = %+v, %v", pos, ok)
	}
	if pos, ok := Lookup(entries, HashChannel("c")); ok || pos != (Position{}) {
		t.Errorf("Lookup(c) = %+v, %v; want not found", pos, ok)
	}
	if _, ok := Lookup(nil, a); ok {
		t.Error("Lookup in no entries found something")
	}
}

func TestParseCursorRejects(t *testing.T) {
	valid := EncodeCursor(entry("a", realEpoch, realSeq, realTime))
	validRaw, _ := base64.RawURLEncoding.DecodeString(valid)
	body := validRaw[:len(validRaw)-1]

	entryBytes := func(epoch, seq, ms uint64) []byte {
		b := binary.BigEndian.AppendUint32(nil, HashChannel("a"))
		b = binary.AppendUvarint(b, epoch)
		b = binary.AppendUvarint(b, seq)
		return binary.AppendUvarint(b, ms)
	}
	withVersion := func(v byte, rest ...[]byte) []byte {
		b := []byte{v}
		for _, r := range rest {
			b = append(b, r...)
		}
		return b
	}
	badCheck := append(append([]byte(nil), body...), validRaw[len(validRaw)-1]^0x01)

	tooLong := strings.Repeat("A", MaxCursorLen+1)
	// padded is a cursor that would be valid without its "=" padding.
	padded := func(body []byte) string {
		raw := append(append([]byte(nil), body...), byte(crc32.ChecksumIEEE(body)))
		text := base64.URLEncoding.EncodeToString(raw)
		if !strings.HasSuffix(text, "=") {
			t.Fatalf("test setup: %q has no padding", text)
		}
		return text
	}

	tests := []struct {
		name string
		text string
	}{
		{"empty", ""},
		{"too long", tooLong},
		{"standard alphabet +", strings.Replace(valid, valid[3:4], "+", 1)},
		{"standard alphabet /", strings.Replace(valid, valid[3:4], "/", 1)},
		{"padding", padded(withVersion(1, entryBytes(1, 2, 300)))},
		{"comma", valid[:4] + "," + valid[5:]},
		{"space", " " + valid},
		{"impossible length", valid + "A"},
		{"version only", rawCursor([]byte{cursorVersion})},
		{"check byte only", base64.RawURLEncoding.EncodeToString([]byte{cursorVersion})},
		{"version 0", rawCursor(withVersion(0, entryBytes(1, 2, 3)))},
		{"version 2", rawCursor(withVersion(2, entryBytes(1, 2, 3)))},
		{"bad check byte", base64.RawURLEncoding.EncodeToString(badCheck)},
		{"entry without varints", rawCursor(withVersion(1, []byte{1, 2, 3, 4}))},
		{"entry shorter than its hash", rawCursor(withVersion(1, []byte{1, 2, 3}))},
		{"entry cut inside its seq", rawCursor(withVersion(1, entryBytes(realEpoch, realSeq, realTime)[:12]))},
		{"entry cut inside a varint", rawCursor(withVersion(1, entryBytes(1, 2, 3)[:4], []byte{0x80}))},
		{"trailing byte", rawCursor(withVersion(1, entryBytes(1, 2, 3), []byte{0}))},
		{"trailing partial entry", rawCursor(withVersion(1, entryBytes(1, 2, 3), entryBytes(1, 2, 3)[:6]))},
		{"epoch beyond uint32", rawCursor(withVersion(1, entryBytes(1<<32, 2, 3)))},
		{"time beyond 2^62", rawCursor(withVersion(1, entryBytes(1, 2, 1<<62+1)))},
		{"varint overflow", rawCursor(withVersion(1, entryBytes(1, 2, 3)[:5], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, []byte{0, 0}))},
	}
	// The crafted cursors must be wrong only where the test says: the same
	// construction with good values parses.
	if _, ok := ParseCursor(rawCursor(withVersion(1, entryBytes(1, 2, 3)))); !ok {
		t.Fatal("a crafted valid cursor does not parse: rawCursor is broken")
	}
	if _, ok := ParseCursor(valid); !ok {
		t.Fatal("a valid cursor does not parse")
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if entries, ok := ParseCursor(tt.text); ok || entries != nil {
				t.Errorf("ParseCursor(%q) = %+v, %v; want nil, false", tt.text, entries, ok)
			}
		})
	}
}

// encoding/base64 skips CR and LF anywhere in its input, so ParseCursor
// accepts a cursor with line breaks in it although no cursor it wrote has
// any (a lastEventID query parameter can carry them as %0A/%0D).
func TestParseCursorRejectsLineBreaks(t *testing.T) {
	valid := EncodeCursor(entry("a", realEpoch, realSeq, realTime))
	for _, text := range []string{valid + "\n", valid[:5] + "\r\n" + valid[5:], "\n" + valid} {
		if entries, ok := ParseCursor(text); ok {
			t.Errorf("ParseCursor(%q) = %+v, true; want false", text, entries)
		}
	}
}

// The length limit is on the text: the longest cursor within MaxCursorLen
// parses, one more entry does not.
func TestParseCursorLengthLimit(t *testing.T) {
	small := entry("a", 1, 1, 1) // 7 raw bytes
	n := 0
	for base64.RawURLEncoding.EncodedLen(2+7*(n+1)) <= MaxCursorLen {
		n++
	}
	entries := make([]ChannelPosition, n+1)
	for i := range entries {
		entries[i] = small
	}
	within, beyond := EncodeCursor(entries[:n]...), EncodeCursor(entries...)
	if len(within) > MaxCursorLen || len(beyond) <= MaxCursorLen {
		t.Fatalf("test setup: lengths %d and %d do not straddle %d", len(within), len(beyond), MaxCursorLen)
	}
	if got, ok := ParseCursor(within); !ok || len(got) != n {
		t.Errorf("cursor of %d bytes (<= %d) did not parse", len(within), MaxCursorLen)
	}
	if _, ok := ParseCursor(beyond); ok {
		t.Errorf("cursor of %d bytes (> %d) parsed", len(beyond), MaxCursorLen)
	}
}

// A corrupted id must not be read as another position: the check byte and
// the version catch most single-bit flips.
func TestParseCursorCatchesFlippedBits(t *testing.T) {
	entries := []ChannelPosition{entry("a", 12345, 678, realTime), entry("b", realEpoch, realSeq, realTime)}
	raw, _ := base64.RawURLEncoding.DecodeString(EncodeCursor(entries...))

	flips, accepted := 0, 0
	for i := range raw {
		for bit := range 8 {
			flipped := append([]byte(nil), raw...)
			flipped[i] ^= 1 << bit
			flips++
			if got, ok := ParseCursor(base64.RawURLEncoding.EncodeToString(flipped)); ok {
				accepted++
				if reflect.DeepEqual(got, entries) {
					t.Errorf("flipping bit %d of byte %d gave back the same entries", bit, i)
				}
			}
		}
	}
	t.Logf("%d of %d single-bit flips of the raw bytes accepted", accepted, flips)
	if accepted*20 > flips {
		t.Errorf("%d of %d single-bit flips were accepted, want under 5%%", accepted, flips)
	}

	// Flipping bits of the text's characters, keeping to the alphabet.
	text := EncodeCursor(entries...)
	flips, accepted = 0, 0
	for i := range len(text) {
		for bit := range 7 {
			c := text[i] ^ 1<<bit
			if !strings.ContainsRune("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", rune(c)) {
				continue
			}
			flips++
			if _, ok := ParseCursor(text[:i] + string(c) + text[i+1:]); ok {
				accepted++
			}
		}
	}
	t.Logf("%d of %d single-bit flips of the text accepted", accepted, flips)
	if accepted*20 > flips {
		t.Errorf("%d of %d character bit flips were accepted, want under 5%%", accepted, flips)
	}
}

// FuzzParseCursor: ParseCursor never panics, and whatever it accepts is a
// cursor whose canonical encoding parses back to the same entries and is
// no longer than the input.
func FuzzParseCursor(f *testing.F) {
	f.Add(EncodeCursor(entry("a", 1, 1, 1)))
	f.Add(EncodeCursor(entry("a", realEpoch, realSeq, realTime), entry("b", 0, 0, 0)))
	f.Add(EncodeCursor(ChannelPosition{Hash: math.MaxUint32, Pos: Position{Epoch: math.MaxUint32, Seq: math.MaxUint64, Time: 1 << 62}}))
	f.Add(rawCursor([]byte{1, 0, 0, 0, 1, 0x80, 0x00, 1, 1})) // non-minimal varint
	f.Add(rawCursor([]byte{1}))
	f.Add(rawCursor([]byte{2, 0, 0, 0, 1, 1, 1, 1}))
	f.Add("")
	f.Add("AQ")
	f.Add("AQID,AQID")
	f.Add("////")
	f.Add("AQ==")

	f.Fuzz(func(t *testing.T, text string) {
		entries, ok := ParseCursor(text)
		if !ok {
			if entries != nil {
				t.Fatalf("ParseCursor(%q) failed but returned %+v", text, entries)
			}
			return
		}
		if len(entries) == 0 {
			t.Fatalf("ParseCursor(%q) accepted a cursor without entries", text)
		}
		canonical := EncodeCursor(entries...)
		again, ok := ParseCursor(canonical)
		if !ok || !reflect.DeepEqual(again, entries) {
			t.Fatalf("ParseCursor(%q) = %+v, but its re-encoding %q parses as %+v, %v", text, entries, canonical, again, ok)
		}
		if len(canonical) > len(text) {
			t.Fatalf("canonical form %q of %q is longer than it", canonical, text)
		}
		if EncodeCursor(again...) != canonical {
			t.Fatalf("canonical form %q is not a fixed point", canonical)
		}
	})
}

// A stream's own ids must parse back: a cursor naming MaxCursorChannels
// channels, every value at its largest, fits MaxCursorLen.
func TestCursorOfMaxCursorChannelsParsesBack(t *testing.T) {
	entries := make([]ChannelPosition, MaxCursorChannels)
	for i := range entries {
		entries[i] = ChannelPosition{Hash: uint32(i), Pos: Position{Epoch: math.MaxUint32, Seq: math.MaxUint64, Time: 1 << 62}}
	}
	text := EncodeCursor(entries...)
	got, ok := ParseCursor(text)
	if !ok || len(got) != len(entries) {
		t.Fatalf("a cursor of %d channels (%d bytes, limit %d) does not parse back", len(entries), len(text), MaxCursorLen)
	}
	if more := EncodeCursor(append(entries, entries[0])...); len(more) <= MaxCursorLen {
		t.Logf("one channel more still fits (%d bytes): MaxCursorChannels is conservative", len(more))
	}
}

// FuzzCursorRoundTrip: any list of positions a hub gives (a time from 0
// to 2^62) encodes into a URL-safe token without "," of at most 40 bytes
// per channel (SPEC S4) that parses back to the same list, whose last
// entry per channel is the one Lookup finds; an encoder reused for another
// cursor first gives the same text. raw is cut into 24-byte entries: hash,
// epoch, seq, time (big endian).
func FuzzCursorRoundTrip(f *testing.F) {
	f.Add([]byte("\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x01\x8c\x00\x00\x00\x00"), []byte{})
	f.Add(bytes.Repeat([]byte{0xff}, 48), []byte("\x00\x00\x00\x01"))
	f.Add(bytes.Repeat([]byte{0x80}, 24*3), bytes.Repeat([]byte{0x7f}, 30))
	f.Fuzz(func(t *testing.T, raw, other []byte) {
		entries := fuzzEntries(raw)
		if len(entries) == 0 || len(entries) > MaxCursorChannels {
			return
		}
		var enc CursorEncoder
		enc.Encode(fuzzEntries(other)) // the buffers hold another cursor first
		text := string(enc.Encode(entries))
		if text != EncodeCursor(entries...) {
			t.Fatalf("a reused encoder gives %q, a new one %q", text, EncodeCursor(entries...))
		}
		if i := strings.IndexFunc(text, func(r rune) bool {
			return !strings.ContainsRune("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", r)
		}); i >= 0 {
			t.Fatalf("cursor %q has %q, not URL-safe base64", text, text[i])
		}
		if len(text) > 40*len(entries) || len(text) > MaxCursorLen {
			t.Fatalf("cursor of %d channels is %d bytes", len(entries), len(text))
		}
		got, ok := ParseCursor(text)
		if !ok || !reflect.DeepEqual(got, entries) {
			t.Fatalf("%+v encodes as %q, which parses as %+v, %v", entries, text, got, ok)
		}
		for i, e := range entries {
			pos, found := Lookup(got, e.Hash)
			last := slices.IndexFunc(entries[i+1:], func(later ChannelPosition) bool { return later.Hash == e.Hash }) < 0
			if !found || (last && pos != e.Pos) {
				t.Fatalf("Lookup of %08x in %+v: %+v, %v", e.Hash, got, pos, found)
			}
		}
	})
}

// fuzzEntries cuts raw into cursor entries of 24 bytes, the time taken
// modulo 2^62+1.
func fuzzEntries(raw []byte) []ChannelPosition {
	var out []ChannelPosition
	for ; len(raw) >= 24; raw = raw[24:] {
		out = append(out, ChannelPosition{Hash: binary.BigEndian.Uint32(raw), Pos: Position{
			Epoch: binary.BigEndian.Uint32(raw[4:]),
			Seq:   binary.BigEndian.Uint64(raw[8:]),
			Time:  int64(binary.BigEndian.Uint64(raw[16:]) % (1<<62 + 1)),
		}})
	}
	return out
}
