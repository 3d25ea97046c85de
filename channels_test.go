package caddysse

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"strings"
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
		// a backslash is text (only one before a brace escapes it): the
		// template was left to the replacer whole, and its list items
		// lost the text around them
		{[]string{`pre\x:` + topics}, "/?t=a,user:victim", `[pre\x:a pre\x:user:victim]`},
		{[]string{topics}, "/?t=a,b,a", "[a b]"},
		{[]string{"news," + topics}, "/?t=x,y", "[news x y]"},
		{[]string{"u:{http.request.uri.query.u}:" + topics}, "/?u=1&t=a,b", "[u:1:a u:1:b]"},
		// only the query lists channels: any other value is one name, and
		// a comma makes it invalid
		{[]string{"p:{http.request.uri.path}"}, "/a,b", "channel_invalid"}, // through the replacer
		{[]string{"p:{http.request.uri.path}"}, "/a", "[p:/a]"},
		{[]string{"{http.request.uri.query.t}:{http.request.uri.path}"}, "/a,b?t=x", "channel_invalid"},
		{[]string{"{http.request.uri.path}:{http.request.uri.query.u}"}, "/a,b", "channel_unresolved"}, // 403 before 400
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
	for _, values := range [][]string{{"a, b"}, {"a", "b"}} {
		names, rej := expandChannels(t, []string{"w:{http.request.header.X-Wallet}"}, "/", http.Header{"X-Wallet": values})
		if rej == nil || rej.code != "channel_invalid" {
			t.Errorf("a header of %q: %v %v, want channel_invalid (a header names one channel)", values, names, rej)
		}
	}
}

// A value from authentication names one channel, whole: split at its
// commas, a user named "alice,bob" got bob's channel from
// user:{http.auth.user.id}, and a client certificate's subject ("CN=alice,
// O=Example") the channel of everyone in its organization.
func TestAnIdentityWithACommaNamesNoOtherChannel(t *testing.T) {
	const pw = "$2a$04$zq6zgeepS0RPbHhdxac/9OUWX0Zoof7AlzCU.W3jpCx0AhpKyaRDa" // "pw", bcrypt cost 4
	srv := startCaddy(t, `
:{PORT} {
	route /user {
		basic_auth {
			"alice,bob" `+pw+`
			bob `+pw+`
		}
		sse {
			channel user:{http.auth.user.id}
		}
	}
	sse /events {
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	basic := func(user string) string {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":pw"))
	}
	req, err := http.NewRequest(http.MethodGet, srv.base+"/user", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", basic("alice,bob"))
	resp, err := requestClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body := []byte("(a stream)")
	if resp.StatusCode != http.StatusOK {
		body, _ = io.ReadAll(resp.Body)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `"channel_invalid"`) {
		t.Fatalf("the user \"alice,bob\": %d %s, want 400 channel_invalid", resp.StatusCode, body)
	}
	c := srv.subscribe("/user", header("Authorization", basic("bob")))
	defer c.close()
	srv.publish("/events", map[string]any{"channel": "user:bob", "data": "for bob"})
	if got := c.next().Data; got != "for bob" {
		t.Fatalf("bob got %q", got)
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

// A request naming far more channels than max_channels is refused without
// keeping them all first: a query of a few hundred thousand items (within
// net/http's 1 MB of headers) made that many map entries and names before
// its 400: 44 MB for 200k items (14 MB now), on every such request. The items
// are still checked (an invalid one is told before too_many_channels).
func TestTooManyChannelsAreRefusedWithoutKeepingThemAll(t *testing.T) {
	var list strings.Builder
	for i := range 200_000 {
		if i > 0 {
			list.WriteByte(',')
		}
		list.WriteString("c" + strconv.Itoa(i))
	}
	target := "/events?channels=" + list.String()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, rej := expandChannels(t, []string{"{http.request.uri.query.channels}"}, target, nil)
	runtime.ReadMemStats(&after)
	if rej == nil || rej.code != "too_many_channels" {
		t.Fatalf("got %v, want too_many_channels", rej)
	}
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("resolving 200k channels allocated %.1f MB", float64(allocated)/(1<<20))
	// the query's own copies (the request, its parsed form, the list's
	// split) are about 14 MB; keeping every name added 30 MB more
	if allocated > 24<<20 {
		t.Fatalf("refusing 200k channels allocated %.1f MB: the names were kept", float64(allocated)/(1<<20))
	}
	_, rej = expandChannels(t, []string{"{http.request.uri.query.channels}"}, target+",bad{", nil)
	if rej == nil || rej.code != "channel_invalid" {
		t.Fatalf("an invalid item after the cap: got %v, want channel_invalid", rej)
	}
}

// FuzzChannelTemplateKeepsItsText: a template of text around one query or
// header placeholder names, for any value, the channels made of that text
// around the value, or, for a query, around each item of a list (the white
// space around each item and each name trimmed), and nothing else; a blank
// value is unresolved, and every name is a valid channel name.
func FuzzChannelTemplateKeepsItsText(f *testing.F) {
	f.Add("public:", "", "news", false)
	f.Add("public:", ":x", "news,user:victim", false)
	f.Add(" a ", " b ", " x , y ", true)
	f.Add("", "", "a,,b", false)
	f.Add("p", "", " ", true)
	f.Add("p", "", "a{b", false)
	f.Add("", "", "\xff", false)
	f.Add("u\u00a0", "\u3000", "\u0085a,b", false)
	f.Fuzz(func(t *testing.T, before, after, value string, inHeader bool) {
		if strings.ContainsAny(before+after, "{}\\,") {
			t.Skip() // text with a list separator or braces of its own
		}
		raw := before + "{http.request.uri.query.c}" + after
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.URL.RawQuery = "c=" + url.QueryEscape(value)
		// a header carries a value without control characters or white
		// space at either end; another value goes in the query
		if inHeader && !strings.ContainsFunc(value, func(c rune) bool { return c < ' ' && c != '\t' || c == 0x7f }) && strings.Trim(value, " \t") == value {
			raw = before + "{http.request.header.X-C}" + after
			r.URL.RawQuery = ""
			r.Header.Set("X-C", value)
		}
		h := &Handler{MaxChannels: DefaultMaxChannels, channelTemplates: []template{compileTemplate(raw)}}
		names, rej := h.resolveChannels(r, replacerFor(r))

		wantCode, wantNames := expectedChannels(before, after, value, r.URL.RawQuery != "", h.MaxChannels)
		gotCode := ""
		if rej != nil {
			gotCode = rej.code
		}
		if gotCode != wantCode || !slices.Equal(names, wantNames) {
			t.Fatalf("template %q with %q: %q %q, want %q %q", raw, value, names, gotCode, wantNames, wantCode)
		}
		for _, name := range names {
			if err := validateChannelName(name); err != nil {
				t.Fatalf("template %q with %q named the invalid channel %q: %v", raw, value, name, err)
			}
			if strings.TrimSpace(name) != name {
				t.Fatalf("template %q with %q named %q, not trimmed", raw, value, name)
			}
		}
	})
}

// expectedChannels is what a template of text around one placeholder
// names for the placeholder's value, following the README: the value is
// one channel, or, for a query parameter (query), a list of them if it has
// a comma; each list item is trimmed and must not be empty; each name is
// trimmed and must be valid.
func expectedChannels(before, after, value string, query bool, maxChannels int) (code string, names []string) {
	if strings.TrimSpace(value) == "" {
		return "channel_unresolved", nil
	}
	items := []string{value}
	if query && strings.Contains(value, ",") {
		items = strings.Split(value, ",")
		for i := range items {
			if items[i] = strings.TrimSpace(items[i]); items[i] == "" {
				return "channel_invalid", nil
			}
		}
	}
	for _, item := range items {
		name := strings.TrimSpace(before + item + after)
		if validateChannelName(name) != nil {
			return "channel_invalid", nil
		}
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	if len(names) > maxChannels {
		return "too_many_channels", nil
	}
	return "", names
}

// Behind forward_auth, the user is the header its copy_headers takes from
// the auth server's reply (forward_auth sets no {http.auth.user.*}
// placeholder, as README says): a stream opens on that user's channel, never
// on one named by a header the client sent itself, and a template on
// {http.auth.user.id} stays unresolved.
func TestBehindForwardAuthTheUserIsTheCopiedHeader(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	handle /events {
		forward_auth 127.0.0.1:{PORT2} {
			uri /auth
			copy_headers X-User
		}
		sse {
			channel user:{http.request.header.X-User}
			principal {http.request.header.X-User}
		}
	}
	handle /by-user-id {
		forward_auth 127.0.0.1:{PORT2} {
			uri /auth
		}
		sse {
			channel user:{http.auth.user.id}
		}
	}
	handle /publish {
		sse {
			publish {
				secret `+testSecret+`
			}
		}
	}
}
:{PORT2} {
	@alice header Authorization "Bearer alice-token"
	handle @alice {
		header X-User alice
		respond 204
	}
	respond 401
}
`)
	resp := do(t, http.MethodGet, srv.base+"/events", nil, "")
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("without a token: status %d, want the auth server's 401", resp.StatusCode)
	}
	c := srv.subscribe("/events", header("Authorization", "Bearer alice-token", "X-User", "bob"))
	srv.publish("/publish", map[string]any{"channel": "user:bob", "data": "for bob"})
	srv.publish("/publish", map[string]any{"channel": "user:alice", "data": "for alice"})
	if ev := c.next(); ev.Data != "for alice" {
		t.Fatalf("got %+v, want alice's event only", ev)
	}
	// {http.auth.user.id} behind forward_auth: unresolved
	resp = do(t, http.MethodGet, srv.base+"/by-user-id", header("Authorization", "Bearer alice-token"), "")
	assertError(t, resp, http.StatusForbidden, "channel_unresolved")
}

// README, "With other handlers and proxies": forward_auth runs the handlers
// after it inside its request to the auth server, so each open stream
// counts as a request in flight to that server for its whole life (what
// unhealthy_request_count and least_conn read) — except with writer
// takeover on HTTP/1.1, which releases it when the stream is handed off.
// The count is Caddy's own, from the admin API's /reverse_proxy/upstreams.
func TestForwardAuthCountsStreamsInFlightUnlessTakenOver(t *testing.T) {
	t.Setenv("SSE_TEST_WRITER", "") // the writer given in the site wins
	for _, writer := range bothWriters {
		t.Run(writer, func(t *testing.T) {
			srv, admin := startCaddyWithAdmin(t, `
:{PORT} {
	forward_auth 127.0.0.1:{PORT2} {
		uri /auth
	}
	sse /events {
		writer `+writer+`
		channel a
	}
}
:{PORT2} {
	respond 204
}
`)
			for range 3 {
				srv.subscribe("/events", nil).comment("ok")
			}
			want := 3
			if writer == "takeover" {
				want = 0
			}
			var got int
			eventually(t, fmt.Sprintf("%d requests in flight to the auth server", want), func() bool {
				got = authRequestsInFlight(t, admin)
				return got == want
			})
		})
	}
}

// authRequestsInFlight is the num_requests the admin API reports for the
// one upstream of the config.
func authRequestsInFlight(t *testing.T, admin string) int {
	t.Helper()
	resp, err := requestClient.Get(admin + "/reverse_proxy/upstreams")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var upstreams []struct {
		NumRequests int `json:"num_requests"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&upstreams); err != nil || len(upstreams) != 1 {
		t.Fatalf("upstreams %+v: %v", upstreams, err)
	}
	return upstreams[0].NumRequests
}
