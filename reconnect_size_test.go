package caddysse

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// The header list size of a reconnect counts each field with 32 bytes of
// its own, and an HTTP/2 client's cookies as one field each (the server
// joins them into one Cookie header): twenty cookies are 19 fields more
// than their joined header, which a reckoning of the joined one missed.
func TestReconnectFieldListSizeCountsEachCookie(t *testing.T) {
	r, _ := http.NewRequest(http.MethodGet, "https://example.com/events?channels=a", nil)
	r.RequestURI, r.TLS = "/events?channels=a", &tls.ConnectionState{}
	base := fieldListReconnectSize(r, 1)
	crumbs := make([]string, 20)
	for i := range crumbs {
		crumbs[i] = "c=v"
	}
	r.Header.Set("Cookie", strings.Join(crumbs, "; "))
	want := base + 20*(len("cookie")+len("c=v")+32)
	if got := fieldListReconnectSize(r, 1); got != want {
		t.Fatalf("size %d with 20 cookies, want %d", got, want)
	}
	// a Last-Event-ID of the request is replaced, not added to
	r.Header.Set("Last-Event-ID", strings.Repeat("x", 5000))
	if got := fieldListReconnectSize(r, 1); got != want {
		t.Fatalf("size %d with a Last-Event-ID of its own, want %d", got, want)
	}
}

// README, "Streams of many channels": with the default max_header_size an
// HTTP/1.1 stream takes about 350 channels named like
// tenant-42:project-007:updates and about 88 of the longest (200-byte)
// names, which it said were 70 (that is HTTP/2's figure).
func TestREADMEChannelCountsOnHTTP1(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		max_channels 423
	}
}
`)
	names := func(n int, format string) string {
		list := make([]string, n)
		for i := range list {
			list[i] = fmt.Sprintf(format, i)
		}
		return strings.Join(list, ",")
	}
	long := strings.Repeat("x", 197) + "%03d"
	for _, tc := range []struct {
		n      int
		format string
		fits   bool
	}{
		{340, "tenant-42:project-%03d:updates", true},
		{370, "tenant-42:project-%03d:updates", false},
		{85, long, true},
		{95, long, false},
	} {
		// a plain GET, not openStream: its reader goroutine took the body
		// of a refusal from under the ReadAll here (a CI run read "")
		resp, err := http.Get(srv.base + "/events?channels=" + names(tc.n, tc.format))
		if err != nil {
			t.Fatal(err)
		}
		body := []byte("(a stream)")
		if resp.StatusCode != http.StatusOK {
			body, _ = io.ReadAll(resp.Body)
		}
		resp.Body.Close()
		refused := resp.StatusCode == http.StatusBadRequest && strings.Contains(string(body), `"too_many_channels"`)
		if tc.fits && resp.StatusCode != http.StatusOK || !tc.fits && !refused {
			t.Errorf("%d channels of %d bytes: %d %s, want fitting %v", tc.n, len(fmt.Sprintf(tc.format, 0)), resp.StatusCode, body, tc.fits)
		}
	}
}
