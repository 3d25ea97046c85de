package caddysse

import (
	"iter"
	"net/url"
	"strings"
)

// The query values a stream's start needs (a {http.request.uri.query.*}
// placeholder, the lastEventID parameter) are found without url.Query: its
// map was where a stream's start grew the request goroutine's stack, and
// it was built up to three times per stream (docs/PERFORMANCE.md).

// queryValues is strings.Join(u.Query()[key], ",").
func queryValues(u *url.URL, key string) string {
	if manyPairs(u.RawQuery) {
		return strings.Join(u.Query()[key], ",")
	}
	var joined string
	var b []byte // from a second value on
	n := 0
	for v := range valuesOf(u.RawQuery, key) {
		switch n {
		case 0:
			joined = v
		case 1:
			b = append(append(append(b, joined...), ','), v...)
		default:
			b = append(append(b, ','), v...)
		}
		n++
	}
	if n > 1 {
		return string(b)
	}
	return joined
}

// queryFirst is u.Query().Get(key).
func queryFirst(u *url.URL, key string) string {
	if manyPairs(u.RawQuery) {
		return u.Query().Get(key)
	}
	for v := range valuesOf(u.RawQuery, key) {
		return v
	}
	return ""
}

// manyPairs reports whether a query has more pairs than the scan here
// takes on: url.Query then decides, with its limit on their number
// (GODEBUG urlmaxqueryparams).
func manyPairs(raw string) bool { return strings.Count(raw, "&") >= maxScannedPairs }

// maxScannedPairs is how many query pairs valuesOf scans at most.
const maxScannedPairs = 1000

// valuesOf yields the values of key in a raw query, in order, as
// url.ParseQuery reads them: pairs split at "&", a pair with a ";" or an
// escape that does not decode skipped.
func valuesOf(raw, key string) iter.Seq[string] {
	return func(yield func(string) bool) {
		for raw != "" {
			var pair string
			pair, raw, _ = strings.Cut(raw, "&")
			if pair == "" || strings.IndexByte(pair, ';') >= 0 {
				continue
			}
			k, v, _ := strings.Cut(pair, "=")
			if !queryKeyIs(k, key) {
				continue
			}
			v, err := url.QueryUnescape(v)
			if err != nil {
				continue
			}
			if !yield(v) {
				return
			}
		}
	}
}

// queryKeyIs reports whether the escaped query key k is key; a key that
// does not unescape matches nothing, as in ParseQuery.
func queryKeyIs(k, key string) bool {
	if strings.IndexByte(k, '%') < 0 && strings.IndexByte(k, '+') < 0 {
		return k == key
	}
	u, err := url.QueryUnescape(k)
	return err == nil && u == key
}
