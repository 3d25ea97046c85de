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
