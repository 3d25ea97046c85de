package caddysse

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// replacerFor returns Caddy's replacer for r, as a request in Caddy has it.
func replacerFor(r *http.Request) *caddy.Replacer {
	return caddyhttp.NewTestReplacer(r)
}

// resolveBoth resolves a template with the compiled fast path and with
// Caddy's replacer, which must agree.
func resolveBoth(t *testing.T, raw string, r *http.Request) (string, bool) {
	t.Helper()
	repl := replacerFor(r)
	fast, fastOK := compileTemplate(raw).resolve(r, repl)
	slow, err := repl.ReplaceOrErr(raw, true, true)
	if fastOK != (err == nil) || (fastOK && fast != slow) {
		t.Fatalf("template %q on %s %v: compiled gives (%q, %v), the replacer (%q, %v)", raw, r.URL, r.Header, fast, fastOK, slow, err)
	}
	return fast, fastOK
}

func TestCompiledTemplatesAgreeWithTheReplacer(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/events?channels=a,b&user=u%207&dup=x&dup=y&empty=", nil)
	r.Header.Set("X-User", "42")
	r.Header.Add("X-Multi", "p")
	r.Header.Add("X-Multi", "q")
	r = r.WithContext(context.Background())
	cases := []struct {
		raw  string
		want string
		ok   bool
	}{
		{"news", "news", true},
		{"{http.request.uri.query.channels}", "a,b", true},
		{"user:{http.request.header.X-User}", "user:42", true},
		{"user:{http.request.header.x-user}", "user:42", true},
		{"{http.request.uri.query.user}/{http.request.header.X-User}", "u 7/42", true},
		{"{http.request.uri.query.dup}", "x,y", true},
		{"{http.request.header.X-Multi}", "p,q", true},
		{"{http.request.uri.query.missing}", "", false},
		{"{http.request.uri.query.empty}", "", false},
		{"u:{http.request.header.X-None}", "", false},
		{"{http.request.uri.path}", "/events", true},    // not compiled: the replacer
		{"{http.request.bogus}", "", false},             // unknown: the replacer
		{"{http.request.uri.query.user:def}", "", true}, // a default: the replacer decides
		{`\{literal\}`, "", true},
		{`a\b:{http.request.uri.query.channels}`, `a\b:a,b`, true},
	}
	for _, tc := range cases {
		got, ok := resolveBoth(t, tc.raw, r)
		if tc.want != "" && (got != tc.want || ok != tc.ok) {
			t.Errorf("%q = (%q, %v), want (%q, %v)", tc.raw, got, ok, tc.want, tc.ok)
		}
	}
	for _, raw := range []string{"{http.request.uri.query.channels}", "user:{http.request.header.X-User}", "news", `a\b:{http.request.uri.query.channels}`} {
		if compileTemplate(raw).parts == nil {
			t.Errorf("%q is not compiled", raw)
		}
	}
}

func FuzzCompiledTemplatesAgreeWithTheReplacer(f *testing.F) {
	f.Add("{http.request.uri.query.c}", "c=a", "X-A", "v")
	f.Add("x:{http.request.header.X-A}:{http.request.uri.query.c}", "c=a&c=b", "x-a", "")
	f.Add("{{http.request.uri.query.c}}", "c=}", "X-A", "{")
	f.Add("a}b{http.request.header.}", "", "", "")
	f.Add(`a\b:{http.request.uri.query.c\}\{http.request.header.X\A}\`, `c\=a\`, `X\A`, `\`)
	f.Fuzz(func(t *testing.T, raw, query, header, value string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.URL.RawQuery = query
		if header != "" && !hasCtl(header) && !hasCtl(value) {
			r.Header.Set(header, value)
		}
		resolveBoth(t, raw, r)
	})
}

func hasCtl(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < ' ' || s[i] == 0x7f || s[i] == ':' {
			return true
		}
	}
	return false
}
