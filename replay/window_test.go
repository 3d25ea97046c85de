package replay

import (
	"math/rand/v2"
	"testing"
)

// sliceWindow is a Window over a slice, as a log other than Memory would
// build from what it fetched.
type sliceWindow []*Event

func (w sliceWindow) Len() int        { return len(w) }
func (w sliceWindow) At(i int) *Event { return w[i] }

// timeOf is the publish time given to seq in test histories.
func timeOf(seq uint64) int64 { return 1_700_000_000_000 + int64(seq)*10 }

// history returns a window retaining seqs from..to (inclusive) of epoch;
// from > to gives an empty window.
func history(epoch uint32, from, to uint64) sliceWindow {
	var w sliceWindow
	for seq := from; seq <= to && seq > 0; seq++ {
		w = append(w, &Event{Pos: Position{Epoch: epoch, Seq: seq, Time: timeOf(seq)}})
	}
	return w
}

func pos(epoch uint32, seq uint64) Position {
	return Position{Epoch: epoch, Seq: seq, Time: timeOf(seq)}
}

func seqsOf(events []*Event) []uint64 {
	var s []uint64
	for _, ev := range events {
		s = append(s, ev.Pos.Seq)
	}
	return s
}

func equalSeqs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// seqRange returns from..to inclusive, or nil if to < from.
func seqRange(from, to uint64) []uint64 {
	var s []uint64
	for seq := from; seq <= to; seq++ {
		s = append(s, seq)
	}
	return s
}

// TestSelectRules has one case per rule of Select's doc comment (SPEC S5).
func TestSelectRules(t *testing.T) {
	const E, other = 7, 8
	tests := []struct {
		name      string
		window    sliceWindow
		head      Position
		after     Position
		limit     int
		want      []uint64
		truncated bool
	}{
		{
			name: "zero position on an empty channel: nothing, not truncated",
			head: Position{}, after: Position{}, limit: 10,
		},
		{
			name:   "zero position with history from seq 1: full replay",
			window: history(E, 1, 5), head: pos(E, 5), after: Position{}, limit: 10,
			want: seqRange(1, 5),
		},
		{
			name:   "zero position with history from seq 1, exactly limit: not truncated",
			window: history(E, 1, 5), head: pos(E, 5), after: Position{}, limit: 5,
			want: seqRange(1, 5),
		},
		{
			name:   "zero position with history from seq 1, more than limit: newest, truncated",
			window: history(E, 1, 5), head: pos(E, 5), after: Position{}, limit: 3,
			want: seqRange(3, 5), truncated: true,
		},
		{
			name:   "zero position with seq 1 evicted: newest, truncated",
			window: history(E, 3, 5), head: pos(E, 5), after: Position{}, limit: 10,
			want: seqRange(3, 5), truncated: true,
		},
		{
			name:   "zero position with seq 1 evicted and more than limit: newest limit, truncated",
			window: history(E, 3, 9), head: pos(E, 9), after: Position{}, limit: 2,
			want: seqRange(8, 9), truncated: true,
		},
		{
			name:   "zero position, all events expired: truncated, nothing to replay",
			window: nil, head: pos(E, 5), after: Position{}, limit: 10,
			truncated: true,
		},
		{
			name:   "epoch mismatch: truncated",
			window: history(E, 1, 5), head: pos(E, 5), after: pos(other, 3), limit: 10,
			want: seqRange(1, 5), truncated: true,
		},
		{
			name:   "epoch mismatch, more than limit: newest limit",
			window: history(E, 1, 5), head: pos(E, 5), after: pos(other, 3), limit: 2,
			want: seqRange(4, 5), truncated: true,
		},
		{
			name:   "position on a channel that has no history left: truncated",
			window: nil, head: Position{}, after: pos(E, 3), limit: 10,
			truncated: true,
		},
		{
			name:   "after newer than head: history rewritten, truncated",
			window: history(E, 1, 5), head: pos(E, 5), after: pos(E, 7), limit: 10,
			want: seqRange(1, 5), truncated: true,
		},
		{
			name:   "equal seq, same time: up to date",
			window: history(E, 1, 5), head: pos(E, 5), after: pos(E, 5), limit: 10,
		},
		{
			name:   "equal seq, same time, nothing retained: up to date",
			window: nil, head: pos(E, 5), after: pos(E, 5), limit: 10,
		},
		{
			name:   "equal seq, different time: rewritten, truncated",
			window: history(E, 1, 5), head: pos(E, 5),
			after: Position{Epoch: E, Seq: 5, Time: timeOf(5) + 1}, limit: 10,
			want: seqRange(1, 5), truncated: true,
		},
		{
			name:   "follows on: the events after",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 4), limit: 10,
			want: seqRange(5, 10),
		},
		{
			name:   "event at after evicted, the next retained: follows on",
			window: history(E, 5, 10), head: pos(E, 10), after: pos(E, 4), limit: 10,
			want: seqRange(5, 10),
		},
		{
			name:   "event after the cursor evicted: truncated",
			window: history(E, 6, 10), head: pos(E, 10), after: pos(E, 4), limit: 10,
			want: seqRange(6, 10), truncated: true,
		},
		{
			name:   "events after the cursor all expired: truncated",
			window: nil, head: pos(E, 10), after: pos(E, 4), limit: 10,
			truncated: true,
		},
		{
			name:   "retained event at after.Seq has another time: truncated",
			window: history(E, 1, 10), head: pos(E, 10),
			after: Position{Epoch: E, Seq: 4, Time: timeOf(4) - 1}, limit: 10,
			want: seqRange(1, 10), truncated: true,
		},
		{
			name:   "retained oldest event at after.Seq has another time: truncated",
			window: history(E, 4, 10), head: pos(E, 10),
			after: Position{Epoch: E, Seq: 4, Time: timeOf(4) + 5}, limit: 3,
			want: seqRange(8, 10), truncated: true,
		},
		{
			name:   "more than limit: newest limit, truncated",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 2), limit: 5,
			want: seqRange(6, 10), truncated: true,
		},
		{
			name:   "exactly limit: not truncated",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 5), limit: 5,
			want: seqRange(6, 10),
		},
		{
			name:   "one under limit: not truncated",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 6), limit: 5,
			want: seqRange(7, 10),
		},
		{
			name:   "limit 0 with events to replay: truncated, nothing",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 6), limit: 0,
			truncated: true,
		},
		{
			name:   "limit 0, up to date: not truncated",
			window: history(E, 1, 10), head: pos(E, 10), after: pos(E, 10), limit: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			page := Select(tt.window, tt.head, tt.after, tt.limit)
			if got := seqsOf(page.Events); !equalSeqs(got, tt.want) {
				t.Errorf("events %v, want %v", got, tt.want)
			}
			if page.Truncated != tt.truncated {
				t.Errorf("truncated = %v, want %v", page.Truncated, tt.truncated)
			}
			if page.Head != tt.head {
				t.Errorf("head = %+v, want %+v", page.Head, tt.head)
			}
			for i, ev := range page.Events {
				if ev != tt.window[int(ev.Pos.Seq-tt.window[0].Pos.Seq)] {
					t.Errorf("event %d is not the window's own event", i)
				}
			}
		})
	}
}

func TestPageLast(t *testing.T) {
	head := pos(1, 9)
	if got := (Page{Head: head}).Last(); got != head {
		t.Errorf("Last of an empty page = %+v, want head %+v", got, head)
	}
	p := Page{Head: head, Events: history(1, 3, 5)}
	if got := p.Last(); got != pos(1, 5) {
		t.Errorf("Last = %+v, want the last event's position", got)
	}
}

func TestPositionFollowsAndCovers(t *testing.T) {
	zero := Position{}
	if !zero.IsZero() || pos(1, 1).IsZero() {
		t.Error("IsZero is wrong")
	}
	if !zero.Follows(pos(9, 1)) || zero.Follows(pos(9, 2)) {
		t.Error("the zero position is followed by seq 1 of any epoch, and nothing else")
	}
	if !pos(1, 4).Follows(pos(1, 5)) || pos(1, 4).Follows(pos(2, 5)) || pos(1, 4).Follows(pos(1, 6)) || pos(1, 4).Follows(pos(1, 4)) {
		t.Error("Follows must mean same epoch, next seq")
	}
	if !pos(1, 4).Covers(pos(1, 4)) || !pos(1, 4).Covers(pos(1, 1)) || pos(1, 4).Covers(pos(1, 5)) || pos(1, 4).Covers(pos(2, 1)) {
		t.Error("Covers must mean same epoch, not newer")
	}
	if zero.Covers(zero) || zero.Covers(pos(0, 0)) {
		t.Error("the zero position covers nothing")
	}
	rewritten := pos(1, 4) // the same seq at another time: a failover reused it
	rewritten.Time++
	if !pos(1, 4).Holds(pos(1, 3)) || pos(1, 4).Holds(rewritten) || pos(1, 4).Holds(pos(1, 5)) || zero.Holds(pos(1, 1)) {
		t.Error("Holds must mean covered and not contradicted")
	}
}

// A failover that lost a channel's newest events gives their seqs to new
// events: a stream at seq 5 (time 5000) meets seq 4 again, published after
// it, or seq 5 at another time. Those contradict the history it wrote (it
// must end as truncated, not take them for duplicates); the events it
// wrote, older and at their own times, do not.
func TestPositionContradictsARewrittenHistory(t *testing.T) {
	at := func(seq uint64, ms int64) Position { return Position{Epoch: 1, Seq: seq, Time: ms} }
	stream := at(5, 5000)
	for _, tc := range []struct {
		q    Position
		want bool
		why  string
	}{
		{at(4, 6000), true, "an older seq published after the stream's event: lost and reused"},
		{at(3, 7000), true, "two seqs back, published later: two events lost"},
		{at(5, 5001), true, "the stream's own seq at another time"},
		{at(5, 4999), true, "the stream's own seq at an earlier time"},
		{at(4, 4000), false, "an event the stream wrote"},
		{at(4, 5000), false, "an event the stream wrote, in the same millisecond"},
		{at(5, 5000), false, "the stream's own event"},
		{at(6, 9000), false, "the next event"},
		{Position{Epoch: 2, Seq: 1, Time: 9000}, false, "another epoch: not this history's to judge"},
	} {
		if got := stream.Contradicts(tc.q); got != tc.want {
			t.Errorf("%+v contradicts %+v: %v, want %v (%s)", stream, tc.q, got, tc.want, tc.why)
		}
		if tc.want && stream.Holds(tc.q) {
			t.Errorf("a stream at %+v holds %+v (%s): taken for a duplicate", stream, tc.q, tc.why)
		}
	}
	if (Position{}).Contradicts(at(1, 1)) {
		t.Error("the zero position is contradicted by nothing")
	}
}

// TestSelectInvariants checks, over random histories and cursors, what any
// page must satisfy whatever rule produced it: its events are the newest
// retained ones, at most limit, oldest first; an untruncated page follows on
// from the cursor without a gap and ends at the head; a truncated page
// holds as many newest events as the limit allows.
func TestSelectInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 20000 {
		epoch := uint32(1 + rng.IntN(2))
		headSeq := uint64(rng.IntN(12))
		var w sliceWindow
		var head Position
		if headSeq > 0 {
			head = pos(epoch, headSeq)
			oldest := 1 + uint64(rng.IntN(int(headSeq)+1)) // headSeq+1: nothing retained
			w = history(epoch, oldest, headSeq)
		}
		var after Position
		switch rng.IntN(4) {
		case 0: // zero position
		case 1: // exact position, maybe in another epoch
			after = pos(uint32(1+rng.IntN(2)), uint64(1+rng.IntN(14)))
		case 2: // a rewritten time
			after = pos(epoch, uint64(1+rng.IntN(14)))
			after.Time += int64(1 + rng.IntN(3))
		default: // same epoch, plausible seq
			after = pos(epoch, uint64(rng.IntN(int(headSeq)+1)))
		}
		limit := rng.IntN(8)

		page := Select(w, head, after, limit)
		got := seqsOf(page.Events)
		fail := func(why string) {
			t.Fatalf("%s: window %v head %+v after %+v limit %d: events %v truncated %v",
				why, seqsOf(w), head, after, limit, got, page.Truncated)
		}
		if len(got) > limit {
			fail("more events than limit")
		}
		if page.Head != head {
			fail("head changed")
		}
		if len(got) > 0 && (got[len(got)-1] != headSeq || !equalSeqs(got, seqRange(got[0], headSeq))) {
			fail("events are not a contiguous tail ending at the head")
		}
		if page.Truncated {
			if len(got) != min(limit, len(w)) {
				fail("a truncated page must hold the newest min(limit, retained) events")
			}
			continue
		}
		// Not truncated: the stream is at page.Last() with nothing missed.
		if page.Last() != head {
			fail("an untruncated page must bring the stream to the head")
		}
		switch {
		case len(got) > 0 && after.IsZero():
			if got[0] != 1 {
				fail("an untruncated replay from the zero position must start at seq 1")
			}
		case len(got) > 0:
			if after.Epoch != epoch || got[0] != after.Seq+1 {
				fail("an untruncated replay must start right after the cursor, in its epoch")
			}
			if i := int(after.Seq) - int(w[0].Pos.Seq); i >= 0 && w[i].Pos.Time != after.Time {
				fail("an untruncated replay must not follow a rewritten event")
			}
		case !after.IsZero():
			if after != head {
				fail("an empty untruncated page must mean the cursor is the head")
			}
		default:
			if headSeq != 0 {
				fail("an empty untruncated page for the zero position must mean an empty channel")
			}
		}
	}
}
