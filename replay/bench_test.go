package replay

import (
	"fmt"
	"strconv"
	"testing"
	"time"
)

func benchEntries(n int) []ChannelPosition {
	entries := make([]ChannelPosition, n)
	for i := range entries {
		entries[i] = ChannelPosition{
			Hash: HashChannel(fmt.Sprint("channel-", i)),
			Pos:  Position{Epoch: realEpoch - uint32(i), Seq: realSeq + uint64(i), Time: realTime},
		}
	}
	return entries
}

// BenchmarkCursorEncoder is the per-event id of a stream, from a reused
// encoder: "next-event" moves one seq per call, as a stream's events do;
// "same-event" keeps the positions, as a loop writing one event to the
// streams of its channel in turn does (the encoder keeps the last text).
// It must not allocate.
func BenchmarkCursorEncoder(b *testing.B) {
	for _, n := range []int{1, 32} {
		for _, moving := range []bool{true, false} {
			name := fmt.Sprint(n, "ch/same-event")
			if moving {
				name = fmt.Sprint(n, "ch/next-event")
			}
			b.Run(name, func(b *testing.B) {
				entries := benchEntries(n)
				var enc CursorEncoder
				enc.Encode(entries)
				b.ReportAllocs()
				for i := 0; b.Loop(); i++ {
					if moving {
						entries[i%n].Pos.Seq++
					}
					enc.Encode(entries)
				}
			})
		}
	}
}

// BenchmarkEncodeCursor is the id of a publish reply: a fresh string.
func BenchmarkEncodeCursor(b *testing.B) {
	for _, n := range []int{1, 32} {
		b.Run(fmt.Sprint(n, "ch"), func(b *testing.B) {
			entries := benchEntries(n)
			b.ReportAllocs()
			for b.Loop() {
				_ = EncodeCursor(entries...)
			}
		})
	}
}

// BenchmarkParseCursor is the Last-Event-ID of a reconnect.
func BenchmarkParseCursor(b *testing.B) {
	for _, n := range []int{1, 32} {
		b.Run(fmt.Sprint(n, "ch"), func(b *testing.B) {
			text := EncodeCursor(benchEntries(n)...)
			b.ReportAllocs()
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				if _, ok := ParseCursor(text); !ok {
					b.Fatal("cursor does not parse")
				}
			}
		})
	}
}

// BenchmarkMemoryRead is a reconnect replaying a whole 1000-event history.
func BenchmarkMemoryRead(b *testing.B) {
	m := NewMemory()
	frame := []byte("event: update\ndata: {\"price\": 42}\n")
	var first *Event
	for i := range 1001 {
		ev := m.Append("a", frame, Limits{Count: 1001}, nil)
		if i == 0 {
			first = ev
		}
	}
	after := first.Pos
	b.ReportAllocs()
	for b.Loop() {
		page := m.Read("a", &after, 1000)
		if len(page.Events) != 1000 || page.Truncated {
			b.Fatalf("read %d events, truncated %v", len(page.Events), page.Truncated)
		}
	}
}

// BenchmarkMemoryAppend is the history's share of a publish.
func BenchmarkMemoryAppend(b *testing.B) {
	m := NewMemory()
	frame := []byte("event: update\ndata: {\"price\": 42}\n")
	lim := Limits{Count: 1000}
	b.ReportAllocs()
	for b.Loop() {
		m.Append("a", frame, lim, nil)
	}
}

// BenchmarkAppendDuringSweep is a publish while the log is swept over and
// over (it is once a minute), 100k channels: how long the longest publish
// waited (max-µs) tells whether the sweep holds the whole log.
func BenchmarkAppendDuringSweep(b *testing.B) {
	m := NewMemory()
	frame := []byte("event: update\ndata: {\"price\": 42}\n")
	lim := Limits{Count: 100, MaxAge: time.Hour}
	const channels = 100_000
	names := make([]string, channels)
	for i := range names {
		names[i] = "user:" + strconv.Itoa(i)
		m.Append(names[i], frame, lim, nil)
	}
	stop := make(chan struct{})
	swept := make(chan struct{})
	go func() {
		defer close(swept)
		for {
			select {
			case <-stop:
				return
			default:
				m.Sweep(nil)
			}
		}
	}()
	var longest time.Duration
	i := 0
	for b.Loop() {
		began := time.Now()
		m.Append(names[i%channels], frame, lim, nil)
		longest = max(longest, time.Since(began))
		i++
	}
	close(stop)
	<-swept
	b.ReportMetric(float64(longest.Microseconds()), "max-µs")
}
