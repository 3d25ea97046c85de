package caddysse

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestAdaptGoldens adapts each testdata/adapt/*.caddyfiletest (a Caddyfile,
// a line of dashes, the expected JSON) like Caddy core's own adapt tests,
// comparing the JSON by value so the golden can be laid out for reading.
func TestAdaptGoldens(t *testing.T) {
	files, err := filepath.Glob("testdata/adapt/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		t.Fatalf("no goldens found: %v", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			raw, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			caddyfileText, expected, ok := strings.Cut(string(raw), "----------")
			if !ok {
				t.Fatal("missing the ---------- separator")
			}
			actual, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), map[string]any{"filename": file})
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			var got, want any
			if err := json.Unmarshal(actual, &got); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal([]byte(expected), &want); err != nil {
				t.Fatalf("the golden's JSON: %v", err)
			}
			if !reflect.DeepEqual(got, want) {
				pretty, _ := json.MarshalIndent(got, "", "\t")
				t.Fatalf("adapted config differs from the golden; got:\n%s", pretty)
			}
		})
	}
}

func TestCaddyfileErrors(t *testing.T) {
	cases := []struct {
		name, input, want string
	}{
		{"unknown subdirective", "sse {\n\tchanel a\n}", `unrecognized sse subdirective "chanel"`},
		{"stray comma in a channel", "sse {\n\tchannel news,\n}", "empty channel"},
		{"argument after directive", "sse extra {\n\tchannel a\n}", "wrong argument count"},
		{"channel without template", "sse {\n\tchannel\n}", "wrong argument count"},
		{"bad duration", "sse {\n\theartbeat soon\n}", "positive duration"},
		{"negative retry", "sse {\n\tretry -1s\n}", "positive duration"},
		{"history count", "sse {\n\thistory many\n}", "history: count"},
		{"history too many args", "sse {\n\thistory 1 1h 2\n}", "wrong argument count"},
		{"history age", "sse {\n\thistory 10 forever\n}", "history: max age"},
		{"zero replay limit", "sse {\n\treplay_limit 0\n}", "positive integer"},
		{"bad size", "sse {\n\tmax_event_size big\n}", "positive size"},
		{"duplicate namespace", "sse {\n\tnamespace a\n\tnamespace b\n}", "more than once"},
		{"publish without secret", "sse {\n\tpublish {\n\t}\n}", "secret is required"},
		{"unknown publish subdirective", "sse {\n\tpublish {\n\t\tsecret x\n\t\ttoken y\n\t}\n}", `unrecognized publish subdirective "token"`},
		{"publish argument", "sse {\n\tpublish x {\n\t\tsecret x\n\t}\n}", "wrong argument count"},
		{"principal without template", "sse {\n\tprincipal\n}", "wrong argument count"},
		{"two principal templates", "sse {\n\tprincipal a b\n}", "wrong argument count"},
		{"duplicate principal", "sse {\n\tprincipal a\n\tprincipal b\n}", "more than once"},
		{"zero max_connections", "sse {\n\tmax_connections 0\n}", "positive integer"},
		{"bad max_connections_per_principal", "sse {\n\tmax_connections_per_principal two\n}", "positive integer"},
		{"bad lease_ttl", "sse {\n\tlease_ttl forever\n}", "positive duration"},
		{"lease_ttl off", "sse {\n\tlease_ttl off\n}", "positive duration"},
		{"unknown rejections mode", "sse {\n\trejections silent\n}", "must be status or in_stream"},
		{"rejections without mode", "sse {\n\trejections\n}", "wrong argument count"},
		{"bad throttle", "sse {\n\tthrottle 0s\n}", "positive duration"},
		{"throttle too many args", "sse {\n\tthrottle 1m 2m\n}", "wrong argument count"},
		{"cluster with sentinel", "sse {\n\tredis {\n\t\taddresses 127.0.0.1:1\n\t\tcluster\n\t\tsentinel m\n\t}\n}", "not both"},
		{"max_retries 0", "sse {\n\tredis {\n\t\turl redis://127.0.0.1:1\n\t\tmax_retries 0\n\t}\n}", "write -1 for none"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// Errors name the file and line, so a user finds the mistake.
func TestCaddyfileErrorsNameFileAndLine(t *testing.T) {
	input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\tbogus 1\n\t}\n}\n"
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
	if err == nil || !strings.Contains(err.Error(), "Caddyfile.test:4") {
		t.Fatalf("error %v, want it to name Caddyfile.test:4", err)
	}
}

func TestCaddyfileFull(t *testing.T) {
	var h Handler
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`sse {
		channel a b
		channel c
		heartbeat off
		history 10
	}`))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(h.Channels, " ") != "a b c" || h.Heartbeat != -1 || h.HistorySize != 10 || h.HistoryMaxAge != 0 {
		t.Fatalf("parsed %+v", h)
	}
}

// An unknown subdirective is an error naming the file and line wherever it
// is: in the sse block, in its publish and redis blocks, and in a block
// opened after a subdirective that takes none.
func TestUnknownSubdirectiveAnywhereNamesFileAndLine(t *testing.T) {
	cases := []struct{ name, body, want string }{
		{"sse block", "\t\tchannel a\n\t\tbogus 1\n", `unrecognized sse subdirective "bogus"`},
		{"publish block", "\t\tchannel a\n\t\tpublish {\n\t\t\tsecret s\n\t\t\tbogus 1\n\t\t}\n", `unrecognized publish subdirective "bogus"`},
		{"redis block", "\t\tchannel a\n\t\tredis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\tbogus 1\n\t\t}\n", `unrecognized redis subdirective "bogus"`},
		{"block after a setting", "\t\tchannel a\n\t\theartbeat 15s {\n\t\t\tbogus 1\n\t\t}\n", "unrecognized sse subdirective"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			input := ":8080 {\n\tsse /events {\n" + tc.body + "\t}\n}\n"
			// the line of "bogus", or of the brace before it
			line := 1 + strings.Count(input[:strings.Index(input, "bogus")], "\n")
			if tc.name == "block after a setting" {
				line--
			}
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
			want := fmt.Sprintf("Caddyfile.test:%d", line)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), want) {
				t.Fatalf("error %v, want %q naming %s", err, tc.want, want)
			}
		})
	}
}

// namespace "{$TENANT}" with TENANT unset is no namespace, as README
// says; unquoted, the unset variable leaves namespace without its
// argument, an error naming the line (not a silent merge of tenants).
func TestNamespaceFromAnUnsetVariable(t *testing.T) {
	const unset = "CADDY_SSE_TEST_SURELY_UNSET_TENANT"
	if _, set := os.LookupEnv(unset); set {
		t.Fatalf("%s must not be set", unset)
	}
	site := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\tnamespace %s\n\t}\n}\n"
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(fmt.Sprintf(site, `"{$`+unset+`}"`)), map[string]any{"filename": "Caddyfile.test"})
	if err != nil {
		t.Fatalf("quoted: %v", err)
	}
	if strings.Contains(string(cfg), `"namespace"`) {
		t.Fatalf("quoted and unset, the handler still has a namespace: %s", cfg)
	}
	_, _, err = caddyconfig.GetAdapter("caddyfile").Adapt([]byte(fmt.Sprintf(site, `{$`+unset+`}`)), map[string]any{"filename": "Caddyfile.test"})
	if err == nil || !strings.Contains(err.Error(), "Caddyfile.test:4") {
		t.Fatalf("unquoted and unset: error %v, want one naming Caddyfile.test:4", err)
	}
}

// README, Scale out with Redis: an unset REDIS_URL is a configuration
// error, and one Caddyfile runs with and without Redis by importing the
// snippet SSE_HUB names, the embedded hub when it is unset. (Seeds 000 and
// 001 ask for in-process delivery where Redis is not configured; the README
// said only that an unset URL is refused.)
func TestHubChosenWhenTheCaddyfileIsAdapted(t *testing.T) {
	const hub, url = "CADDY_SSE_TEST_SURELY_UNSET_HUB", "CADDY_SSE_TEST_SURELY_UNSET_REDIS_URL"
	for _, name := range []string{hub, url} {
		if _, set := os.LookupEnv(name); set {
			t.Fatalf("%s must not be set", name)
		}
	}
	site := "(hub-embedded) {\n}\n(hub-redis) {\n\tredis {$" + url + "}\n}\n" +
		":8080 {\n\tsse /events {\n\t\tchannel a\n\t\timport hub-{$" + hub + ":embedded}\n\t}\n}\n"
	adapt := func() (string, error) {
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(site), map[string]any{"filename": "Caddyfile.test"})
		return string(cfg), err
	}
	cfg, err := adapt()
	if err != nil || strings.Contains(cfg, `"redis"`) {
		t.Fatalf("%s unset: %v %s, want the embedded hub", hub, err, cfg)
	}
	t.Setenv(hub, "redis")
	if _, err := adapt(); err == nil || !strings.Contains(err.Error(), "redis: give a URL or addresses") {
		t.Fatalf("%s=redis and %s unset: error %v, want the unset URL refused", hub, url, err)
	}
	t.Setenv(url, "redis://127.0.0.1:1")
	if cfg, err := adapt(); err != nil || !strings.Contains(cfg, `"redis":{"url":"redis://127.0.0.1:1"}`) {
		t.Fatalf("%s=redis: %v %s, want the Redis hub", hub, err, cfg)
	}
}

// FuzzCaddyfile: the sse directive's parser never panics, and what it
// accepts is a handler config that survives Caddy's JSON as it is, every
// value in the range its subdirective allows (a Caddyfile that loads must
// not change meaning in the JSON that Caddy runs).
func FuzzCaddyfile(f *testing.F) {
	for _, seed := range []string{
		"channel a b\nchannel c\nheartbeat off\nhistory 10",
		"channel user:{http.auth.user.id} {query.topics}\nnamespace shop\nhistory 500 1h\nhistory_bytes 8MiB\npublish {\n\tsecret {env.S}\n}",
		"channel a\nclose_jitter off\nthrottle off\nrejections in_stream\nprincipal {header.X-User}\nmax_connections_per_principal 2",
		"channel a\nredis redis://127.0.0.1:1/2",
		"channel a\nredis {\n\taddresses a:1 b:2\n\tcluster\n\tprefix x:\n\twait_replicas 1 2s\n\tmax_retries -1\n\tdb 0\n\ttls\n}\nfallback local\nwriter takeover",
		"channel a\nredis {\n\tsentinel m\n\tsentinel_username u\n\tsentinel_password \"p w\"\n\taddresses s:26379\n\ttls ca.pem\n}",
		"channel \"{query.a\"",
		"channel `a}`\nheartbeat 1 2",
		"namespace \"\"\nmax_event_size 2TiB",
		"redis {\n}\n}",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, body string) {
		input := ":8080 {\n\tsse {\n" + body + "\n\t}\n}\n"
		adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile"})
		if err != nil {
			return
		}
		var config any
		if err := json.Unmarshal(adapted, &config); err != nil {
			t.Fatalf("adapted %q to invalid JSON: %v", input, err)
		}
		raw := findSSEHandler(config)
		if raw == nil {
			t.Fatalf("adapted %q without the sse handler: %s", input, adapted)
		}
		var h Handler
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatalf("the JSON %s of %q does not load: %v", raw, input, err)
		}
		again, err := json.Marshal(&h)
		if err != nil {
			t.Fatal(err)
		}
		var h2 Handler
		if err := json.Unmarshal(again, &h2); err != nil || !reflect.DeepEqual(h, h2) {
			t.Fatalf("the JSON of %q changes meaning: %+v, then %+v (%v)", input, h, h2, err)
		}
		checkCaddyfileRanges(t, input, &h)
	})
}

// findSSEHandler returns the JSON of the first sse handler in an adapted
// config, without its "handler" key.
func findSSEHandler(v any) json.RawMessage {
	switch x := v.(type) {
	case map[string]any:
		if x["handler"] == "sse" {
			delete(x, "handler")
			raw, _ := json.Marshal(x)
			return raw
		}
		for _, val := range x {
			if raw := findSSEHandler(val); raw != nil {
				return raw
			}
		}
	case []any:
		for _, val := range x {
			if raw := findSSEHandler(val); raw != nil {
				return raw
			}
		}
	}
	return nil
}

// checkCaddyfileRanges fails unless every value the Caddyfile set is one
// its subdirective accepts (zero is unset).
func checkCaddyfileRanges(t *testing.T, input string, h *Handler) {
	t.Helper()
	for _, d := range []struct {
		name string
		v    caddy.Duration
		off  bool
	}{{"heartbeat", h.Heartbeat, true}, {"retry", h.Retry, false}, {"history max age", h.HistoryMaxAge, false},
		{"close_jitter", h.CloseJitter, true}, {"slow_client_timeout", h.SlowClientTimeout, false},
		{"lease_ttl", h.LeaseTTL, false}, {"throttle", h.Throttle, true}} {
		if d.v < 0 && !(d.off && d.v == -1) {
			t.Fatalf("%q set %s to %v", input, d.name, time.Duration(d.v))
		}
	}
	for _, n := range []int{h.HistorySize, h.ReplayLimit, h.MaxChannels, h.Queue, h.MaxConnections, h.MaxConnectionsPerPrincipal} {
		if n < 0 {
			t.Fatalf("%q set a count to %d", input, n)
		}
	}
	for _, n := range []int64{h.HistoryBytes, h.MaxEventSize, h.QueueBytes} {
		if n < 0 || n > 1<<40 {
			t.Fatalf("%q set a size to %d", input, n)
		}
	}
	for _, tmpl := range h.Channels {
		if checkChannelTemplate(tmpl) != nil {
			t.Fatalf("%q set the channel template %q", input, tmpl)
		}
	}
	if checkPrincipalTemplate(h.Principal) != nil {
		t.Fatalf("%q set the principal template %q", input, h.Principal)
	}
	if h.Namespace != "" && validateNamespace(h.Namespace) != nil {
		t.Fatalf("%q set the namespace %q", input, h.Namespace)
	}
	switch {
	case h.Rejections != "" && h.Rejections != rejectionsStatus && h.Rejections != rejectionsInStream,
		h.Fallback != "" && h.Fallback != fallbackLocal,
		h.Writer != "" && h.Writer != writerNetHTTP && h.Writer != writerTakeover:
		t.Fatalf("%q set rejections %q, fallback %q, writer %q", input, h.Rejections, h.Fallback, h.Writer)
	case h.Publish != nil && h.Publish.Secret == "":
		t.Fatalf("%q set a publish block without a secret", input)
	}
	if c := h.Redis; c != nil {
		switch {
		case (c.URL == "") == (len(c.Addresses) == 0):
			t.Fatalf("%q set redis with url %q and addresses %q", input, c.URL, c.Addresses)
		case c.Cluster && c.Sentinel != "":
			t.Fatalf("%q set redis cluster and sentinel", input)
		case c.DB != nil && *c.DB < 0, c.WaitReplicas < 0, c.PoolSize < 0, c.MaxRetries < -1:
			t.Fatalf("%q set redis numbers out of range: %+v", input, c)
		}
	}
}

// A value out of its subdirective's range is refused naming the file and
// line, not only when the config loads (Validate), where the error names
// neither.
func TestOutOfRangeValuesNameFileAndLine(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{"max_channels 424", "max_channels: at most 423"},
		{"lease_ttl 50ms", "lease_ttl: at least 100ms"},
	} {
		t.Run(tc.line, func(t *testing.T) {
			input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + tc.line + "\n\t}\n}\n"
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile.test:4") {
				t.Fatalf("error %v, want %q naming Caddyfile.test:4", err, tc.want)
			}
		})
	}
	for _, line := range []string{"max_channels 423", "lease_ttl 100ms"} {
		input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\t" + line + "\n\t}\n}\n"
		if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"}); err != nil {
			t.Errorf("%s: %v", line, err)
		}
	}
}
