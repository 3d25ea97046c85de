package pubsub

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// notice is an event as Redis announces it: "<epoch>:<seq>:<time>:<type
// length>:<type><data>" (see redis.lua).
type notice struct {
	pos  replay.Position
	typ  string
	data string
}

var errBadNotice = errors.New("malformed event notification")

func parseNotice(payload string) (notice, error) {
	var n notice
	var nums [4]uint64
	rest := payload
	for i := range nums {
		field, after, ok := strings.Cut(rest, ":")
		if !ok {
			return n, errBadNotice
		}
		v, err := strconv.ParseUint(field, 10, 64)
		if err != nil {
			return n, errBadNotice
		}
		nums[i], rest = v, after
	}
	if nums[0] > 0xFFFFFFFF || nums[2] > 1<<62 || nums[3] > uint64(len(rest)) {
		return n, errBadNotice
	}
	n.pos = replay.Position{Epoch: uint32(nums[0]), Seq: nums[1], Time: int64(nums[2])}
	n.typ, n.data = rest[:nums[3]], rest[nums[3]:]
	return n, nil
}

// encodeEvent turns an event that came through Redis into a replay.Event,
// validating it again (SPEC S3): anything may write to Redis. An event with
// an invalid type or data that is not UTF-8 keeps its position but loses
// its content: it is written as an id-only block, which moves the client's
// Last-Event-ID without dispatching anything, so ids stay contiguous and the
// bad event is never written raw. valid reports which it was.
func encodeEvent(pos replay.Position, typ, data string) (ev *replay.Event, valid bool) {
	if !wire.ValidEventType(typ) || wire.IsReservedType(typ) || !utf8.ValidString(data) {
		return &replay.Event{Pos: pos}, false
	}
	frame := make([]byte, 0, len("event: \n")+len(typ)+len("data: \n")+len(data)+len(data)/16)
	return &replay.Event{Pos: pos, Frame: wire.AppendEvent(frame, typ, []byte(data))}, true
}

// parsePage decodes sse_read_v1's reply:
// {epoch, seq, time, truncated, n, id1, type1, data1, ...}. bad counts
// events whose content was dropped by encodeEvent, and entries left out as
// not the library's.
//
// Only the library appends to a channel's stream, each entry at the seq
// after the last (trims drop the oldest), so the entries of a page have
// seqs from 1 to the head's, rising. One that does not (a backend's plain
// XADD, "<ms>-0") was never announced and holds no position of the
// channel: replayed, it reached only the streams that reconnected, with an
// id whose seq went back. It is left out.
func parsePage(reply any) (page replay.Page, bad int, err error) {
	items, ok := reply.([]any)
	if !ok || len(items) < 5 {
		return page, 0, fmt.Errorf("unexpected read reply %T", reply)
	}
	nums := make([]uint64, 5)
	for i := range nums {
		if nums[i], err = replyUint(items[i]); err != nil {
			return page, 0, err
		}
	}
	page.Head = replay.Position{Epoch: uint32(nums[0]), Seq: nums[1], Time: int64(nums[2])}
	page.Truncated = nums[3] == 1
	// the count is checked against the items before any arithmetic: a
	// count near 2^64 made 5+3n wrap around to the number of items, and
	// the page was then made with a negative capacity (a panic)
	if nums[4] > uint64(len(items)) || len(items) != 5+3*int(nums[4]) {
		return page, 0, fmt.Errorf("read reply has %d items for %d events", len(items), nums[4])
	}
	n := int(nums[4])
	page.Events = make([]*replay.Event, 0, n)
	var last uint64 // the seq of the last entry taken
	for i := range n {
		id, typ, data := replyString(items[5+3*i]), replyString(items[6+3*i]), replyString(items[7+3*i])
		pos, err := positionOfID(page.Head.Epoch, id)
		if err != nil {
			return page, 0, err
		}
		if pos.Seq <= last || pos.Seq > page.Head.Seq {
			bad++ // pos.Seq 0 too
			continue
		}
		last = pos.Seq
		ev, valid := encodeEvent(pos, typ, data)
		if !valid {
			bad++
		}
		page.Events = append(page.Events, ev)
	}
	return page, bad, nil
}

// positionOfID reads a stream entry id "<time>-<seq>".
func positionOfID(epoch uint32, id string) (replay.Position, error) {
	t, s, ok := strings.Cut(id, "-")
	ms, err1 := strconv.ParseInt(t, 10, 64)
	seq, err2 := strconv.ParseUint(s, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return replay.Position{}, fmt.Errorf("bad stream id %q", id)
	}
	return replay.Position{Epoch: epoch, Seq: seq, Time: ms}, nil
}

// parsePublished decodes a publish's reply: {epoch, seq, time} from the
// forms without a count (sse_publish_v2, which a publish falls back to while
// its slot migrates), {epoch, seq, time, repeat} from
// FunctionPublishCounted, whose repeat is 1 for an earlier call's event.
func parsePublished(reply any) (pos replay.Position, repeat bool, err error) {
	items, ok := reply.([]any)
	if !ok || len(items) < 3 || len(items) > 4 {
		return replay.Position{}, false, fmt.Errorf("unexpected publish reply %v", reply)
	}
	var nums [4]uint64
	for i := range items {
		v, err := replyUint(items[i])
		if err != nil {
			return replay.Position{}, false, err
		}
		nums[i] = v
	}
	if nums[3] > 1 {
		return replay.Position{}, false, fmt.Errorf("unexpected publish reply %v", reply)
	}
	return replay.Position{Epoch: uint32(nums[0]), Seq: nums[1], Time: int64(nums[2])}, nums[3] == 1, nil
}

func replyUint(v any) (uint64, error) {
	switch x := v.(type) {
	case int64:
		if x < 0 {
			return 0, fmt.Errorf("negative number %d in reply", x)
		}
		return uint64(x), nil
	case string:
		return strconv.ParseUint(x, 10, 64)
	default:
		return 0, fmt.Errorf("unexpected %T in reply", v)
	}
}

func replyString(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case int64:
		return strconv.FormatInt(x, 10)
	default:
		return fmt.Sprint(v)
	}
}
