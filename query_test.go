package caddysse

import (
	"net/url"
	"strings"
	"testing"
)

func TestQueryScanAgreesWithURLQuery(t *testing.T) {
	for _, raw := range []string{
		"", "a=1", "a=1&a=2&b=3&a=4", "a", "a=", "=x&a=y", "a=%zz&a=ok", "%zz=1&a=2",
		"a%3D=1&a=2", "a+b=1&a%20b=2", "a=1;b=2&a=3", "&&a=1&&", "lastEventID=x%2Cy",
		strings.Repeat("a=1&", 1200) + "a=2", // past the scan: url.Query's limit decides
	} {
		checkQueryScan(t, raw, "a")
		checkQueryScan(t, raw, "a b")
		checkQueryScan(t, raw, "lastEventID")
	}
}

func FuzzQueryScanAgreesWithURLQuery(f *testing.F) {
	f.Add("a=1&a=2&b=%41", "a")
	f.Add("a%2=1&a;=2&+=3", " ")
	f.Fuzz(func(t *testing.T, raw, key string) { checkQueryScan(t, raw, key) })
}

// checkQueryScan checks queryValues and queryFirst against url.Query.
func checkQueryScan(t *testing.T, raw, key string) {
	t.Helper()
	u := &url.URL{RawQuery: raw}
	want := u.Query()[key]
	if got := queryValues(u, key); got != strings.Join(want, ",") {
		t.Fatalf("queryValues(%q, %q) = %q, url.Query has %q", raw, key, got, want)
	}
	if got := queryFirst(u, key); got != u.Query().Get(key) {
		t.Fatalf("queryFirst(%q, %q) = %q, url.Query has %q", raw, key, got, want)
	}
}
