package caddysse

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"hash/fnv"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A backend that appends to a channel's stream with a plain XADD, as the
// docs describe its entries, bypasses the library: its entry (id
// "<ms>-0") has no seq of the channel and was never announced. Live
// streams never got it, yet a reconnect's replay wrote it, with an id
// whose seq went back to 0 — the streams of one channel disagreed, and a
// client cut just after it was told its next replay was truncated. It is
// not part of the channel: neither gets it.
func TestPlainXAddToAChannelsStreamIsNotReplayed(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	one := srv.publishN("a", "e", 1, 1)[1]
	// XADD * after e1's millisecond: "<ms>-0", and the next publish's
	// entry comes after it
	deadline := time.Now().Add(5 * time.Second)
	for redisMillis(t, rds) <= seqOf(t, one).Time {
		if time.Now().After(deadline) {
			t.Fatal("the Redis clock did not move")
		}
	}
	rds.MustCLI("XADD", "sse:{a}:s", "*", "y", "t", "d", "plain")
	srv.publishN("a", "e", 2, 3)
	if got := c.nextData(3); fmt.Sprint(got) != "[e1 e2 e3]" {
		t.Fatalf("live: %v", got)
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", one))
	if r.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatal("the replay after e1 is told truncated")
	}
	for i, want := range []string{"e2", "e3"} {
		ev := r.next()
		if ev.Data != want || seqOf(t, ev.ID).Seq != uint64(i+2) {
			t.Fatalf("replay after e1: event %d is %q at %+v, want %s at seq %d", i, ev.Data, seqOf(t, ev.ID), want, i+2)
		}
	}
}

// redisMillis is the Redis server's clock in milliseconds.
func redisMillis(t *testing.T, rds *redistest.Server) int64 {
	t.Helper()
	f := strings.Fields(rds.MustCLI("TIME"))
	s, err1 := strconv.ParseInt(f[0], 10, 64)
	us, err2 := strconv.ParseInt(f[1], 10, 64)
	if len(f) != 2 || err1 != nil || err2 != nil {
		t.Fatalf("TIME answered %q", f)
	}
	return s*1000 + us/1000
}

// A backend that publishes straight into Redis gets {epoch, seq, time};
// made into a Last-Event-ID as README.md ("Publishing straight into
// Redis") says, with the channel's full name (its namespace too), it
// resumes a stream after that event (SPEC S4), as the id a publish through
// Caddy returns does. The recipe is written here from the docs, not with
// package replay.
func TestDirectPublishReplyMadeALastEventIDResumes(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "namespace shop"))
	c := srv.subscribe("/events?channels=orders", nil) // Caddy loads the library
	c.comment("ok")
	rds.WaitShardSubscribers(t, "sse:{shop:orders}", 1)
	var replies []string
	for _, data := range []string{"d1", "d2", "d3"} {
		replies = append(replies, rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{shop:orders}", "invoice", data))
	}
	if got := c.nextData(3); fmt.Sprint(got) != "[d1 d2 d3]" {
		t.Fatalf("live: %v", got)
	}
	f := strings.Fields(replies[0])
	if len(f) != 3 {
		t.Fatalf("FCALL answered %q, want epoch, seq and time", replies[0])
	}
	var pos [3]uint64
	for i := range pos {
		pos[i], _ = strconv.ParseUint(f[i], 10, 64)
	}
	id := documentedLastEventID("shop:orders", pos[0], pos[1], pos[2])
	r := srv.subscribe("/events?channels=orders", header("Last-Event-ID", id))
	if r.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatalf("the id %s made of %q is told truncated", id, replies[0])
	}
	if got := r.nextData(2); fmt.Sprint(got) != "[d2 d3]" {
		t.Fatalf("replay after d1's id: %v", got)
	}
}

// documentedLastEventID is README.md's recipe: base64url without padding of
// 1, the FNV-1a (32 bits, big endian) of the channel's full name, the
// epoch, seq and time as unsigned varints, and the low byte of the CRC-32
// of all that.
func documentedLastEventID(channel string, epoch, seq, time uint64) string {
	h := fnv.New32a()
	h.Write([]byte(channel))
	raw := binary.BigEndian.AppendUint32([]byte{1}, h.Sum32())
	for _, n := range []uint64{epoch, seq, time} {
		raw = binary.AppendUvarint(raw, n)
	}
	raw = append(raw, byte(crc32.ChecksumIEEE(raw)))
	return base64.RawURLEncoding.EncodeToString(raw)
}
