package pubsub

import (
	"bytes"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// These fuzz the decoding of what Redis sends: announcements on the shard
// channels, and the replies of the library's read and publish. Anything
// may write to Redis (SPEC S3), so none of it may panic or write an event
// raw, and a position of numbers a cursor holds (replay.ParseCursor
// refuses an epoch past 32 bits and a time past 2^62) is read exactly.

// luaNum is redis.lua's num(): a non-negative integer in decimal.
func luaNum(v uint64) string { return strconv.FormatUint(v, 10) }

// luaNotice is the announcement redis.lua's publish makes:
// num(epoch)..':'..num(seq)..':'..num(t)..':'..#typ..':'..typ..data.
func luaNotice(pos replay.Position, typ, data string) string {
	return luaNum(uint64(pos.Epoch)) + ":" + luaNum(pos.Seq) + ":" + luaNum(uint64(pos.Time)) + ":" +
		strconv.Itoa(len(typ)) + ":" + typ + data
}

// luaPage is the reply redis.lua's read makes for a page (result()):
// {epoch, seq, time, truncated, n, id1, type1, data1, ...}, ids being the
// stream entries' "<time>-<seq>".
func luaPage(page replay.Page, types, datas []string) []any {
	truncated := "0"
	if page.Truncated {
		truncated = "1"
	}
	reply := []any{luaNum(uint64(page.Head.Epoch)), luaNum(page.Head.Seq), luaNum(uint64(page.Head.Time)), truncated, luaNum(uint64(len(page.Events)))}
	for i, ev := range page.Events {
		reply = append(reply, luaNum(uint64(ev.Pos.Time))+"-"+luaNum(ev.Pos.Seq), types[i], datas[i])
	}
	return reply
}

// checkCursorRange fails unless pos can be written in a cursor and read
// back from it.
func checkCursorRange(t *testing.T, what string, pos replay.Position) {
	t.Helper()
	if pos.Time < 0 || pos.Time > 1<<62 {
		t.Fatalf("%s: time %d is outside what a cursor holds", what, pos.Time)
	}
	entry := replay.ChannelPosition{Hash: 1, Pos: pos}
	got, ok := replay.ParseCursor(replay.EncodeCursor(entry))
	if !ok || len(got) != 1 || got[0] != entry {
		t.Fatalf("%s: position %+v does not survive a cursor (%+v, %v)", what, pos, got, ok)
	}
}

// checkFrame checks an event's frame as encodeEvent made it: nothing for
// an invalid event; else the "event:" line of a valid type (none for the
// empty type) and one "data:" line per line of data, LF only.
func checkFrame(t *testing.T, frame []byte, valid bool, typ, data string) {
	t.Helper()
	wantValid := wire.ValidEventType(typ) && !wire.IsReservedType(typ) && utf8.ValidString(data)
	if valid != wantValid {
		t.Fatalf("event %q %q: valid %v, want %v", typ, data, valid, wantValid)
	}
	if !valid {
		if len(frame) != 0 {
			t.Fatalf("invalid event %q %q was written as %q", typ, data, frame)
		}
		return
	}
	if bytes.IndexByte(frame, '\r') >= 0 || !bytes.HasSuffix(frame, []byte("\n")) {
		t.Fatalf("event %q %q: frame %q has a CR or an unterminated line", typ, data, frame)
	}
	lines := strings.Split(string(frame[:len(frame)-1]), "\n")
	if typ != "" {
		if lines[0] != "event: "+typ {
			t.Fatalf("event %q: frame %q does not start with its type", typ, frame)
		}
		lines = lines[1:]
	}
	var got []string
	for _, line := range lines {
		value, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("event %q %q: frame %q has the line %q that is not data", typ, data, frame, line)
		}
		got = append(got, value)
	}
	want := strings.ReplaceAll(strings.ReplaceAll(data, "\r\n", "\n"), "\r", "\n")
	if strings.Join(got, "\n") != want {
		t.Fatalf("event %q %q: frame %q carries %q", typ, data, frame, strings.Join(got, "\n"))
	}
}

// FuzzParseNotice: an announcement as redis.lua writes it reads back as
// that event; any other payload is refused or read as an event that
// re-encodes to a payload read the same way; the event is then written
// valid or not at all.
func FuzzParseNotice(f *testing.F) {
	f.Add(uint32(7), uint64(1), int64(1700000000000), "t", "data", "")
	f.Add(uint32(math.MaxUint32), uint64(math.MaxUint64), int64(1<<62), "", "", "1:2:3:0:")
	f.Add(uint32(1), uint64(2), int64(3), "a:b", "c:d\r\ne", "1:2:3:4:a:bc")
	f.Add(uint32(1), uint64(2), int64(3), "sse_truncated", "\xff", "1:2:3:9:x")
	f.Add(uint32(0), uint64(0), int64(0), "\n", "", "4294967296:1:1:0:")
	f.Add(uint32(0), uint64(0), int64(0), "", "", "1:1:4611686018427387905:0:")
	f.Add(uint32(0), uint64(0), int64(-1), "", "", "1:1:1:-1:")
	f.Add(uint32(0), uint64(0), int64(0), "", "", "01:+1:1:0:x")
	f.Fuzz(func(t *testing.T, epoch uint32, seq uint64, tm int64, typ, data, payload string) {
		if n, err := parseNotice(payload); err == nil {
			checkCursorRange(t, "notice "+strconv.Quote(payload), n.pos)
			if !strings.HasSuffix(payload, n.typ+n.data) {
				t.Fatalf("notice %q read as type %q data %q, not its tail", payload, n.typ, n.data)
			}
			again, err := parseNotice(luaNotice(n.pos, n.typ, n.data))
			if err != nil || again != n {
				t.Fatalf("notice %q read as %+v, its re-encoding as %+v, %v", payload, n, again, err)
			}
			ev, valid := encodeEvent(n.pos, n.typ, n.data)
			if ev.Pos != n.pos {
				t.Fatalf("notice %q: event at %+v, want %+v", payload, ev.Pos, n.pos)
			}
			checkFrame(t, ev.Frame, valid, n.typ, n.data)
		}

		if tm < 0 || tm > 1<<62 {
			return // not a time the hub's clock gives
		}
		pos := replay.Position{Epoch: epoch, Seq: seq, Time: tm}
		payload = luaNotice(pos, typ, data)
		n, err := parseNotice(payload)
		if err != nil || n != (notice{pos: pos, typ: typ, data: data}) {
			t.Fatalf("announcement %q of %+v %q %q read as %+v, %v", payload, pos, typ, data, n, err)
		}
	})
}

// FuzzParsePage: a read reply as redis.lua writes it reads back as that
// page; any other reply (fields split at NUL, the first ones also sent as
// integers where bit i of ints says so) is refused or read as a page whose
// events all belong to its head's epoch, whose positions survive a cursor,
// whose frames are valid, and whose re-encoding reads the same.
func FuzzParsePage(f *testing.F) {
	f.Add(uint32(9), uint64(3), int64(1700000000000), false, "a\x00b", "x\x00y\r\nz", "", uint8(0))
	f.Add(uint32(1), uint64(1), int64(0), true, "", "", "0\x000\x000\x000\x000", uint8(0))
	f.Add(uint32(1), uint64(1), int64(0), true, "sse_degraded", "\xff", "1\x002\x003\x001\x001\x005-2\x00t\x00d", uint8(0b11111))
	f.Add(uint32(0), uint64(0), int64(0), false, "", "", "1\x002\x003\x000\x001\x00-5-2\x00t\x00d", uint8(0))
	f.Fuzz(func(t *testing.T, epoch uint32, seq uint64, tm int64, truncated bool, types, datas, fields string, ints uint8) {
		var reply []any
		for i, field := range strings.Split(fields, "\x00") {
			if v, err := strconv.ParseInt(field, 10, 64); err == nil && i < 8 && ints&(1<<i) != 0 {
				reply = append(reply, v)
			} else {
				reply = append(reply, field)
			}
		}
		if page, bad, err := parsePage(reply); err == nil {
			checkPage(t, reply, page, bad)
		}
		if pos, repeat, err := parsePublished(reply); err == nil && numbersInRange(reply) {
			checkCursorRange(t, "publish reply", pos)
			checkNumbers(t, reply, pos)
			flag := uint64(0) // a reply without the fourth item is no repeat
			if len(reply) == 4 {
				flag, _ = replyUint(reply[3])
			}
			if repeat != (flag == 1) {
				t.Fatalf("reply %q read as repeat %v", reply, repeat)
			}
		}

		if tm < 0 || tm > 1<<62 {
			return
		}
		// a page of events at tm, tm+1, ... with seqs seq+1, seq+2, ...
		typeParts, dataParts := strings.Split(types, "\x00"), strings.Split(datas, "\x00")
		n := min(len(typeParts), len(dataParts), 8)
		page := replay.Page{Head: replay.Position{Epoch: epoch, Seq: seq + uint64(n), Time: min(tm+int64(n), 1<<62)}, Truncated: truncated}
		for i := range n {
			pos := replay.Position{Epoch: epoch, Seq: seq + uint64(i) + 1, Time: min(tm+int64(i), 1<<62)}
			page.Events = append(page.Events, &replay.Event{Pos: pos})
		}
		reply = luaPage(page, typeParts[:n], dataParts[:n])
		got, _, err := parsePage(reply)
		if err != nil || got.Head != page.Head || got.Truncated != page.Truncated || len(got.Events) != n {
			t.Fatalf("reply %q of %+v read as %+v, %v", reply, page, got, err)
		}
		for i, ev := range got.Events {
			if ev.Pos != page.Events[i].Pos {
				t.Fatalf("reply %q: event %d at %+v, want %+v", reply, i, ev.Pos, page.Events[i].Pos)
			}
		}
	})
}

// checkPage checks a page parsePage accepted from reply.
func checkPage(t *testing.T, reply []any, page replay.Page, bad int) {
	t.Helper()
	entries := (len(reply) - 5) / 3
	if len(reply) != 5+3*entries || len(page.Events) > entries {
		t.Fatalf("reply %q of %d items read as %d events", reply, len(reply), len(page.Events))
	}
	if numbersInRange(reply) {
		checkCursorRange(t, "page head", page.Head)
		checkNumbers(t, reply, page.Head)
	}
	types, datas := make([]string, len(page.Events)), make([]string, len(page.Events))
	invalid := 0
	j := 0 // the reply's entry of event i: entries not the library's are left out
	for i, ev := range page.Events {
		if ev.Pos.Time <= 1<<62 {
			checkCursorRange(t, "page event", ev.Pos)
		}
		if ev.Pos.Epoch != page.Head.Epoch {
			t.Fatalf("reply %q: event %d of epoch %d in a page of epoch %d", reply, i, ev.Pos.Epoch, page.Head.Epoch)
		}
		if ev.Pos.Seq == 0 || ev.Pos.Seq > page.Head.Seq || (i > 0 && ev.Pos.Seq <= page.Events[i-1].Pos.Seq) {
			t.Fatalf("reply %q: event %d at seq %d, not rising from 1 to the head's %d", reply, i, ev.Pos.Seq, page.Head.Seq)
		}
		for ; j < entries; j++ {
			if pos, err := positionOfID(page.Head.Epoch, replyString(reply[5+3*j])); err == nil && pos == ev.Pos {
				break
			}
		}
		if j == entries {
			t.Fatalf("reply %q: event %d at %+v is none of its entries", reply, i, ev.Pos)
		}
		types[i], datas[i] = replyString(reply[6+3*j]), replyString(reply[7+3*j])
		j++
		valid := len(ev.Frame) > 0
		if !valid {
			invalid++
		}
		checkFrame(t, ev.Frame, valid, types[i], datas[i])
	}
	if bad != invalid+entries-len(page.Events) {
		t.Fatalf("reply %q: %d bad events counted, %d written without content, %d left out", reply, bad, invalid, entries-len(page.Events))
	}
	again, againBad, err := parsePage(luaPage(page, types, datas))
	if err != nil || againBad != invalid || !reflect.DeepEqual(again, page) {
		t.Fatalf("reply %q read as %+v, its re-encoding as %+v, %v", reply, page, again, err)
	}
}

// numbersInRange reports whether the position at the head of a reply has
// numbers a cursor can hold. Others are not refused: such a position only
// comes from data not written by the library (its functions write epochs
// below 2^32 and the clock's times), and refusing it would refuse every
// stream of the channel (503 history_unavailable), while taking it gives
// ids that do not parse back, and a reconnect told truncated (SPEC S4).
func numbersInRange(reply []any) bool {
	epoch, err1 := replyUint(reply[0])
	ms, err2 := replyUint(reply[2])
	return err1 == nil && err2 == nil && epoch <= math.MaxUint32 && ms <= 1<<62
}

// checkNumbers fails unless pos holds the numbers of reply's first three
// items, unchanged: a number too large for its field is refused, not cut.
func checkNumbers(t *testing.T, reply []any, pos replay.Position) {
	t.Helper()
	for i, want := range []uint64{uint64(pos.Epoch), pos.Seq, uint64(pos.Time)} {
		if got, err := replyUint(reply[i]); err != nil || got != want {
			t.Fatalf("reply %q: item %d read as %d", reply, i, want)
		}
	}
}
