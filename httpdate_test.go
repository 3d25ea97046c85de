package caddysse

import (
	"math/rand/v2"
	"net/http"
	"testing"
	"time"
)

// appendHTTPDate agrees with time.Format(http.TimeFormat) over four
// centuries of random instants, in any zone.
func TestAppendHTTPDate(t *testing.T) {
	zone := time.FixedZone("somewhere", -7*3600)
	rng := rand.New(rand.NewPCG(1, 2))
	from := time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	to := time.Date(2300, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	for i := range 100_000 {
		when := time.Unix(from+rng.Int64N(to-from), 0)
		if i%2 == 1 {
			when = when.In(zone)
		}
		want := when.UTC().Format(http.TimeFormat)
		if got := string(appendHTTPDate(nil, when)); got != want {
			t.Fatalf("%v: %q, want %q", when, got, want)
		}
	}
}

// A stream's Date header is the handler's, so that net/http does not
// format one while writing the headers.
func TestSetDate(t *testing.T) {
	hdr := http.Header{}
	now := time.Date(2026, 11, 29, 23, 5, 9, 0, time.UTC)
	setDate(hdr, now)
	if got := hdr.Get("Date"); got != "Sun, 29 Nov 2026 23:05:09 GMT" {
		t.Fatalf("Date %q", got)
	}
}
