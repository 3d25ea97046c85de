package caddysse

import (
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/wire"
)

// A request that reaches a config a reload is closing is told to come back
// within lateArrivalJitter: the new config already serves, and a page opened
// during a reload waited up to close_jitter (5 s) for its stream. On a
// shutdown it is spread over close_jitter as the streams are.
func TestALateArrivalsRetryAfterAReloadIsShort(t *testing.T) {
	const jitter = 5 * time.Second
	longest := func(reason string) time.Duration {
		r := newRegistry(zap.NewNop(), time.Minute, jitter, 0)
		defer r.stop()
		r.closeAll(reason)
		var most time.Duration
		for range 200 {
			n := r.closingNotice()
			if n.reason != reason {
				t.Fatalf("told %q, want %q", n.reason, reason)
			}
			most = max(most, n.retry)
		}
		return most
	}
	if most := longest(reasonReload); most > lateArrivalJitter {
		t.Errorf("after a reload a late arrival was told to retry in %v, want at most %v", most, lateArrivalJitter)
	}
	if most := longest(reasonShutdown); most <= lateArrivalJitter || most > jitter {
		t.Errorf("after a shutdown the longest retry of 200 late arrivals was %v, want within close_jitter %v", most, jitter)
	}
}

// The same through HTTP: a stream request served by the handler of a
// config a reload replaced (TestReplayAcrossReloadReachingTheOldConfig) is
// told server_closing with a retry of at most lateArrivalJitter, though
// that config's close_jitter is the default 5 s.
func TestAStreamRequestReachingAReplacedConfigRetriesSoon(t *testing.T) {
	srv := startCaddy(t, replaySite)
	for range 10 {
		c := srv.behindAConfigOnItsWayOut(t).subscribe("/events?channels=a", nil)
		ev := c.next()
		if ev.Type != wire.TypeServerClosing || time.Duration(ev.Retry)*time.Millisecond > lateArrivalJitter {
			t.Fatalf("got %+v, want server_closing with a retry of at most %v", ev, lateArrivalJitter)
		}
		c.expectEnd()
	}
}
