package pubsub

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/replay"
)

// With fallback local, a publisher (it holds the secret) may name any
// channel while Redis is away: the local events must keep nothing per
// channel name. A count per channel, never forgotten, held about 200 bytes
// per name for the life of the hub (82,000 names of 157 bytes: +16 MiB
// through Caddy). The seqs of each channel still rise.
func TestLocalFallbackKeepsNothingPerChannel(t *testing.T) {
	l := &localFallback{epoch: newLocalEpoch()}
	var last []replay.Position
	deliver := func(_ string, ev *replay.Event) { last = append(last[:0], ev.Pos) }
	pos := func(channel string) replay.Position {
		l.publish(channel, Message{Data: []byte("x")}, deliver)
		return last[0]
	}
	a1, b1, a2 := pos("a"), pos("b"), pos("a")
	if a1.Epoch != l.epoch || b1.Epoch != l.epoch || a2.Seq <= a1.Seq {
		t.Fatalf("positions a %+v, b %+v, a %+v: want the local epoch, and a's seqs rising", a1, b1, a2)
	}
	prefix := strings.Repeat("n", 150)
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range 50_000 {
		pos(fmt.Sprint(prefix, i))
	}
	after := heap()
	if grown := int64(after) - int64(before); grown > 2<<20 {
		t.Fatalf("50,000 channel names published locally left %d KiB on the heap, want nothing per name", grown>>10)
	}
	runtime.KeepAlive(l)
}
