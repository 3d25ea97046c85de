package replay

// Window is a channel's retained history as the replay rules need to see it.
// The in-memory log implements it over its ring buffer; other logs can
// implement it over what they fetched.
type Window interface {
	// Len is how many events are retained.
	Len() int
	// At returns the i-th retained event, oldest first.
	At(i int) *Event
}

// Select applies the replay rules (SPEC S5) to a channel whose retained
// events are w and whose newest position is head: it returns the events
// after position after, at most limit of them. The page is truncated (and
// then holds the newest retained events, at most limit) when the events do
// not follow on from after without a gap:
//   - after is in another epoch than the history (lost or rebuilt), unless
//     after is the zero position and the history still starts at seq 1;
//   - after is newer than head (the history was rewritten);
//   - the event at after is retained but has another time, or the event
//     after it is older than after (rewritten);
//   - the event following after is no longer retained;
//   - more than limit events follow after.
func Select(w Window, head Position, after Position, limit int) Page {
	n := w.Len()
	page := Page{Head: head}
	if after.IsZero() {
		if head.Seq == 0 {
			return page // the channel was and is empty
		}
		if n > 0 && w.At(0).Pos.Seq == 1 {
			return tail(w, 0, limit, page)
		}
		return newest(w, limit, page)
	}
	if after.Epoch != head.Epoch || after.Seq > head.Seq {
		return newest(w, limit, page)
	}
	if after.Seq == head.Seq {
		if after.Time != head.Time {
			return newest(w, limit, page)
		}
		return page
	}
	// after.Seq < head.Seq: the event after it must still be retained.
	if n == 0 {
		return newest(w, limit, page)
	}
	oldest := w.At(0).Pos.Seq
	if oldest > after.Seq+1 {
		return newest(w, limit, page)
	}
	// Seqs are contiguous in a window, so index arithmetic finds them.
	if after.Seq >= oldest {
		if w.At(int(after.Seq-oldest)).Pos.Time != after.Time {
			return newest(w, limit, page)
		}
	} else if w.At(0).Pos.Time < after.Time {
		return newest(w, limit, page) // the next event cannot be older
	}
	return tail(w, int(after.Seq+1-oldest), limit, page)
}

// tail returns the events from index from on, truncated to the newest limit
// if there are more.
func tail(w Window, from, limit int, page Page) Page {
	n := w.Len()
	if n-from > limit {
		from = n - limit
		page.Truncated = true
	}
	page.Events = collect(w, from, n)
	return page
}

// newest returns a truncated page with the newest retained events.
func newest(w Window, limit int, page Page) Page {
	n := w.Len()
	from := n - limit
	if from < 0 {
		from = 0
	}
	page.Events = collect(w, from, n)
	page.Truncated = true
	return page
}

func collect(w Window, from, to int) []*Event {
	if from >= to {
		return nil
	}
	events := make([]*Event, 0, to-from)
	for i := from; i < to; i++ {
		events = append(events, w.At(i))
	}
	return events
}
