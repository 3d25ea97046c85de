package pubsub

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// frameData returns the data of any one-line event as the encoder wrote it,
// and never panics on other bytes.
func FuzzFrameData(f *testing.F) {
	f.Add("throttle", []byte(`{"k":"user|1.2.3.4","ms":60000}`), []byte("data: x\n"))
	f.Add("", []byte(""), []byte("event: t\ndata: "))
	f.Add("t", []byte("data: inside"), []byte("\ndata: \n"))
	f.Fuzz(func(t *testing.T, typ string, data, other []byte) {
		frameData(other) // must not panic
		if !wire.ValidEventType(typ) || bytes.ContainsAny(data, "\r\n") {
			return
		}
		got, ok := frameData(wire.AppendEvent(nil, typ, data))
		if !ok || !bytes.Equal(got, data) {
			t.Fatalf("frameData of event %q %q: %q, %v", typ, data, got, ok)
		}
	})
}

// FuzzThrottleAnnouncement: an announcement as Throttle makes it, read
// back from Redis (encodeEvent) by another instance, throttles the same
// key for the announced time from the event's, no longer; an announcement
// of any other frame never throttles a key for longer than it says.
func FuzzThrottleAnnouncement(f *testing.F) {
	f.Add("\x00user\x001.2.3.4", int64(60000), int64(0), false, []byte(`data: {"k":"a","ms":1000}`+"\n"))
	f.Add("ns\x00<&>\u2028\x00::1", int64(1), int64(5), true, []byte("event: throttle\ndata: {\"k\":\"a\",\"ms\":-5}\n"))
	f.Add("k\"\\", int64(math.MaxInt64/int64(time.Millisecond)), int64(1<<40), false, []byte(`data: {"k":"a","ms":9223372036854775807}`+"\n"))
	f.Add("", int64(0), int64(-1), false, []byte(`data: {"k":"","ms":1}`+"\n"))
	f.Fuzz(func(t *testing.T, key string, ms, age int64, local bool, frame []byte) {
		now := time.Now().UnixMilli()
		// any frame from Redis: never longer than it says
		r := NewRedisThrottles(&Redis{now: time.Now})
		r.apply(&replay.Event{Pos: replay.Position{Epoch: 1, Seq: 1, Time: now - max(age, 0)%(1<<40)}, Frame: frame})
		if data, ok := frameData(frame); ok {
			var a announcement
			if json.Unmarshal(data, &a) == nil {
				bound := time.Duration(math.MaxInt64)
				if a.MS < math.MaxInt64/int64(time.Millisecond) {
					bound = time.Duration(max(a.MS, 0)) * time.Millisecond
				}
				if left, _ := r.known.Remaining(context.Background(), a.Key); left > bound {
					t.Fatalf("frame %q throttles %q for %v", frame, a.Key, left)
				}
			}
		}

		// an announcement Throttle makes: the key and time it names
		if key == "" || !utf8.ValidString(key) || ms < 1 || ms > math.MaxInt64/int64(time.Millisecond) {
			return // not a key or a time Throttle announces
		}
		data, err := json.Marshal(announcement{Key: key, MS: ms})
		if err != nil {
			t.Fatal(err)
		}
		// the announcement is that old, and in force for at least slack more
		const slack = 30 * time.Second
		elapsed := int64(0)
		if ms > slack.Milliseconds() {
			elapsed = max(age, 0) % min(ms-slack.Milliseconds(), now)
		}
		ev, valid := encodeEvent(replay.Position{Epoch: 1, Seq: 1, Time: now - elapsed}, "throttle", string(data))
		if !valid {
			t.Fatalf("announcement %q is not a valid event", data)
		}
		ev.Local = local
		r = NewRedisThrottles(&Redis{now: time.Now})
		r.clocked = true // a load found Redis' clock the same as this instance's
		r.apply(ev)
		left, _ := r.known.Remaining(context.Background(), key)
		want := time.Duration(ms-elapsed) * time.Millisecond
		if local {
			want = time.Duration(ms) * time.Millisecond // from when it arrives
		}
		if left > want || (want >= slack && want-left > slack) {
			t.Fatalf("announcement %q of age %d ms: %q throttled for %v, want %v", data, elapsed, key, left, want)
		}
	})
}
