//go:build linux

package caddysse

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// On a machine that allows io_uring (CI's does) the event loops send
// through it unless told not to: the suite's takeover run then tests that
// path, and CADDY_SSE_IO_URING=0 the write(2) one.
func TestTakeoverLoopsUseIOUringWhereAllowed(t *testing.T) {
	ls := newLoopSet()
	defer ls.Destruct()
	switch {
	case os.Getenv(ringSwitch) == "0":
		if ls.noRing == nil || !strings.Contains(ls.sendsBy(), "write(2)") {
			t.Fatalf("%s=0, and the loops say %q", ringSwitch, ls.sendsBy())
		}
	case ls.noRing != nil && os.Getenv("CI") == "true":
		t.Fatalf("io_uring is unavailable on CI: %v", ls.noRing)
	case ls.noRing == nil && !strings.Contains(ls.sendsBy(), "io_uring"):
		t.Fatalf("the loops say %q", ls.sendsBy())
	}
}

// Streams written in one round share the loop's buffer, which grows while
// the round goes on (a 60 KiB event for each of 30 streams): every chunk
// must still reach its own stream whole and in order, including what the
// sockets did not take at once.
func TestTakeoverRoundsKeepEachStreamsChunks(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		writer takeover
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	// each stream also follows a channel of its own, so that the same
	// event makes chunks of different lengths (their ids differ); 300
	// small streams fill several submissions (submitEvery) in one round
	var small, big []*sseClient
	for i := range 300 {
		pad := fmt.Sprintf("p%d", i)
		small = append(small, srv.subscribe("/events?channels=small,"+pad, nil))
		if i < 30 {
			big = append(big, srv.subscribe("/events?channels=big,"+pad, nil))
		}
	}
	const rounds = 5
	payload := func(i int) string { return fmt.Sprintf("%d:%s", i, strings.Repeat(string(rune('a'+i)), 60<<10)) }
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range rounds {
			srv.publish("/events", map[string]any{"channel": "big", "data": payload(i)})
		}
	}()
	go func() {
		defer wg.Done()
		for i := range rounds * 10 {
			srv.publish("/events", map[string]any{"channel": "small", "data": fmt.Sprintf("small %d\nline two", i)})
		}
	}()
	wg.Wait()
	for n, c := range big {
		for i := range rounds {
			if got := c.next().Data; got != payload(i) {
				t.Fatalf("big stream %d, event %d: %d bytes starting %.20q; want %d bytes", n, i, len(got), got, len(payload(i)))
			}
		}
	}
	for n, c := range small {
		for i := range rounds * 10 {
			if got, want := c.next().Data, fmt.Sprintf("small %d\nline two", i); got != want {
				t.Fatalf("small stream %d: got %q, want %q", n, got, want)
			}
		}
	}
}
