package pubsub

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

type sliceWindow []*replay.Event

func (w sliceWindow) Len() int               { return len(w) }
func (w sliceWindow) At(i int) *replay.Event { return w[i] }

func pageString(p replay.Page) string {
	s := fmt.Sprintf("head=%v trunc=%v [", p.Head, p.Truncated)
	for _, ev := range p.Events {
		s += fmt.Sprintf("%d@%d ", ev.Pos.Seq, ev.Pos.Time)
	}
	return s + "]"
}

// The Redis read function applies the same replay rules as replay.Select
// (SPEC S5): for every kind of cursor, the same page.
func TestReplayRedisReadMatchesSelect(t *testing.T) {
	srv := redistest.Start(t)
	_, b := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	ctx := context.Background()
	lim := replay.Limits{Count: 6, MaxAge: time.Hour, MaxBytes: 1 << 20}
	for i := range 10 {
		if _, err := b.Publish(ctx, "d", Message{Data: []byte(fmt.Sprint(i))}, lim); err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			time.Sleep(2 * time.Millisecond)
		}
	}
	headPage, err := b.Read(ctx, "d", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	head := headPage.Head
	all, err := b.Read(ctx, "d", &replay.Position{}, 1000)
	if err != nil {
		t.Fatal(err)
	}
	w := sliceWindow(all.Events)
	var cursors []replay.Position
	cursors = append(cursors, replay.Position{}, replay.Position{Epoch: head.Epoch}, replay.Position{Epoch: head.Epoch + 1, Seq: 5, Time: head.Time},
		replay.Position{Epoch: head.Epoch, Seq: head.Seq + 1, Time: head.Time})
	for _, ev := range w {
		p := ev.Pos
		cursors = append(cursors, p, replay.Position{Epoch: p.Epoch, Seq: p.Seq, Time: p.Time + 1}, replay.Position{Epoch: p.Epoch, Seq: p.Seq, Time: p.Time - 1})
		if p.Seq > 1 {
			q := replay.Position{Epoch: p.Epoch, Seq: p.Seq - 1, Time: p.Time}
			cursors = append(cursors, q, replay.Position{Epoch: q.Epoch, Seq: q.Seq, Time: q.Time - 1}, replay.Position{Epoch: q.Epoch, Seq: q.Seq, Time: q.Time + 1})
		}
	}
	cursors = append(cursors, replay.Position{Epoch: head.Epoch, Seq: 1, Time: w[0].Pos.Time - 100})
	for _, limit := range []int{1, 3, 100} {
		for _, c := range cursors {
			got, err := b.Read(ctx, "d", &c, limit)
			if err != nil {
				t.Fatal(err)
			}
			want := replay.Select(w, head, c, limit)
			if pageString(got) != pageString(want) {
				t.Errorf("after %v limit %d: redis %s, Select %s", c, limit, pageString(got), pageString(want))
			}
		}
	}
}

// Events older than the max age stay in the stream until the next publish
// trims them, but are no longer retained: a cursor just before the oldest
// retained event replays from it, as Select does, whatever time the cursor
// holds for its seq (a history rewritten by a failover, or a forged id).
// The read started after the cursor's (time, seq) id instead, which is
// before the aged events of that time or later: it replayed them (seqs the
// client had, events past the max age) in a page not marked truncated.
func TestReplayRedisReadSkipsAgedEventsBeforeTheCursor(t *testing.T) {
	srv := redistest.Start(t)
	_, b := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	// a loaded machine may take longer to read every cursor than the newer
	// events live: then the window moved under the reads, and the round is
	// made again on a new channel with twice the max age
	for round, maxAge := 0, 1500*time.Millisecond; ; round, maxAge = round+1, 2*maxAge {
		mismatches, moved := agedEventsRound(t, b, fmt.Sprint("aged-", round), maxAge)
		if moved && round < 3 {
			continue
		}
		if moved {
			t.Fatal("the retained window moved under the reads in every round")
		}
		for _, m := range mismatches {
			t.Error(m)
		}
		return
	}
}

// agedEventsRound runs the test above on channel with maxAge: the
// mismatches between Redis' reads and Select, and whether the retained
// window moved while the cursors were read (the mismatches then prove
// nothing).
func agedEventsRound(t *testing.T, b *Redis, channel string, maxAge time.Duration) (mismatches []string, moved bool) {
	ctx := context.Background()
	lim := replay.Limits{Count: 100, MaxAge: maxAge, MaxBytes: 1 << 20}
	publish := func(i int) replay.Position {
		pos, err := b.Publish(ctx, channel, Message{Data: []byte(fmt.Sprint(i))}, lim)
		if err != nil {
			t.Fatal(err)
		}
		return pos
	}
	var old []replay.Position
	for i := range 5 {
		old = append(old, publish(i))
	}
	time.Sleep(maxAge / 2) // setup: the next events are half a max age younger
	for i := 5; i < 8; i++ {
		publish(i)
	}
	// wait (with a deadline) until the first five are past the max age:
	// still in the stream, as nothing was published since
	var retained replay.Page
	for deadline := time.Now().Add(10 * time.Second); ; {
		var err error
		if retained, err = b.Read(ctx, channel, &replay.Position{}, 1000); err != nil {
			t.Fatal(err)
		}
		if len(retained.Events) > 0 && retained.Events[0].Pos.Seq == 6 {
			break
		}
		if time.Now().After(deadline) || len(retained.Events) < 3 {
			t.Fatalf("the first five events did not age out alone: %s", pageString(retained))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n, err := b.Client().XLen(ctx, b.Key(channel)+":s").Result(); err != nil || n != 8 {
		t.Fatalf("stream has %d entries (%v), want the 8 published", n, err)
	}
	head, w := retained.Head, sliceWindow(retained.Events)
	last := old[4]
	times := []int64{0, last.Time - 1000}
	for _, p := range old {
		times = append(times, p.Time-1, p.Time, p.Time+1)
	}
	for _, ev := range w {
		times = append(times, ev.Pos.Time-1, ev.Pos.Time, ev.Pos.Time+1)
	}
	var cursors []replay.Position
	for _, epoch := range []uint32{head.Epoch, head.Epoch + 1, 0} {
		for seq := range uint64(11) {
			for _, tm := range times {
				cursors = append(cursors, replay.Position{Epoch: epoch, Seq: seq, Time: tm})
			}
		}
	}
	for _, limit := range []int{2, 3, 100} {
		for _, c := range cursors {
			got, err := b.Read(ctx, channel, &c, limit)
			if err != nil {
				t.Fatal(err)
			}
			want := replay.Select(w, head, c, limit)
			if pageString(got) != pageString(want) {
				mismatches = append(mismatches, fmt.Sprintf("after %v limit %d: redis %s, Select %s", c, limit, pageString(got), pageString(want)))
			}
		}
	}
	again, err := b.Read(ctx, channel, &replay.Position{}, 1000)
	if err != nil {
		t.Fatal(err)
	}
	return mismatches, pageString(again) != pageString(retained)
}
