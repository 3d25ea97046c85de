package caddysse

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
)

// expandChannels resolves channel templates for a request as a handler
// with them would.
func expandChannels(t *testing.T, templates []string, target string, hdr http.Header) ([]string, *rejection) {
	t.Helper()
	h := &Handler{MaxChannels: 32}
	for _, raw := range templates {
		h.channelTemplates = append(h.channelTemplates, compileTemplate(raw))
	}
	r := httptest.NewRequest(http.MethodGet, target, nil)
	for k, vs := range hdr {
		r.Header[k] = vs
	}
	return h.resolveChannels(r, replacerFor(r))
}

// A placeholder whose value is a list names one channel per item, each
// with the template's text around it: the template's text is what confines
// a client, and a comma in a value must not get a client out of it.
func TestChannelTemplateListsKeepTheTemplatesText(t *testing.T) {
	const topics = "{http.request.uri.query.t}"
	cases := []struct {
		templates []string
		target    string
		want      string // the names, or the rejection's code
	}{
		{[]string{"public:" + topics}, "/?t=news,user:victim", "[public:news public:user:victim]"},
		{[]string{"public:" + topics}, "/?t=a&t=b", "[public:a public:b]"},
		{[]string{"public:" + topics}, "/?t=a,%20b", "[public:a public:b]"},
		{[]string{"public:" + topics + ":x"}, "/?t=a,b", "[public:a:x public:b:x]"},
		{[]string{topics}, "/?t=a,b,a", "[a b]"},
		{[]string{"news," + topics}, "/?t=x,y", "[news x y]"},
		{[]string{"u:{http.request.uri.query.u}:" + topics}, "/?u=1&t=a,b", "[u:1:a u:1:b]"},
		{[]string{"p:{http.request.uri.path}"}, "/a,b", "[p:/a p:b]"}, // through the replacer
		{[]string{"{http.request.uri.query.a}-{http.request.uri.query.b}"}, "/?a=1,2&b=3,4", "channel_invalid"},
		{[]string{"public:" + topics}, "/?t=a,,b", "channel_invalid"},
		{[]string{"public:" + topics}, "/?t=a,", "channel_invalid"},
		{[]string{"m:{http.request.uri.query.m}"}, "/?m=", "channel_unresolved"},
		{[]string{"m:{http.request.uri.query.m}"}, "/?m=%20", "channel_unresolved"},
		{[]string{"m:{http.request.uri.query.m}"}, "/?m=+", "channel_unresolved"},
		{[]string{"m:{http.request.uri.query.m}"}, "/", "channel_unresolved"},
		{[]string{"w:{http.request.header.X-Wallet}"}, "/", "channel_unresolved"},
		{[]string{"{http.request.uri.query.x}", "{http.request.uri.query.y}"}, "/?x=a%7Bb", "channel_unresolved"}, // 403 before 400
		{[]string{"{http.request.uri.query.x}", "{http.request.uri.query.y}"}, "/?x=a%7Bb&y=b", "channel_invalid"},
		{[]string{"{http.request.uri.query.x},{http.request.uri.query.y}"}, "/?x=a%7Bb", "channel_unresolved"},
		{[]string{"{http.request.uri.query.x}:{http.request.uri.query.y}"}, "/?x=a,,b", "channel_unresolved"},
		{[]string{"{http.request.uri.query.x}:{http.request.uri.query.y}"}, "/?x=a,,b&y=c", "channel_invalid"},
	}
	for _, tc := range cases {
		names, rej := expandChannels(t, tc.templates, tc.target, nil)
		got := fmt.Sprint(names)
		if rej != nil {
			got = rej.code
		}
		if got != tc.want {
			t.Errorf("%v on %s: %s, want %s", tc.templates, tc.target, got, tc.want)
		}
	}
	names, rej := expandChannels(t, []string{"w:{http.request.header.X-Wallet}"}, "/", http.Header{"X-Wallet": {"a, b"}})
	if rej != nil || fmt.Sprint(names) != "[w:a w:b]" {
		t.Errorf("a header list: %v %v", names, rej)
	}
}

// Through Caddy: a stream of `channel public:{query.topics}` never gets an
// event of a channel outside public:, whatever the query says.
func TestChannelPrefixCannotBeEscapedWithAComma(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /public {
		channel public:{query.topics}
	}
	sse /events {
		channel {query.channels}
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	c := srv.subscribe("/public?topics=news,user:victim", nil)
	srv.publish("/events", map[string]any{"channel": "user:victim", "data": "private"})
	srv.publish("/events", map[string]any{"channel": "public:user:victim", "data": "public, second item"})
	srv.publish("/events", map[string]any{"channel": "public:news", "data": "public"})
	if got := fmt.Sprint(c.nextData(2)); got != "[public, second item public]" {
		t.Fatalf("got %s", got)
	}
}
