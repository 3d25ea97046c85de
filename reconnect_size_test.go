package caddysse

import (
	"crypto/tls"
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
