package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// The publisher JWT of Mercure's own tests (publisher_jwt !ChangeMe!,
// publish to every topic): the same key and claims must give the same
// token.
func TestHS256JWTMatchesMercures(t *testing.T) {
	const want = "eyJhbGciOiJIUzI1NiJ9.eyJtZXJjdXJlIjp7InB1Ymxpc2giOlsiKiJdfX0.vhMwOaN5K68BTIhWokMLOeOJO4EPfT64brd8euJOA4M"
	if got := hs256JWT("!ChangeMe!", `{"mercure":{"publish":["*"]}}`); got != want {
		t.Fatalf("got %s\nwant %s", got, want)
	}
}

// Each rival's publish request carries the event where that server's API
// takes it.
func TestRivalPublishRequests(t *testing.T) {
	data := []byte(`{"c":3,"s":7,"t":1}`)
	target := func(raw string) *target {
		u, err := url.Parse(strings.ReplaceAll(raw, "{ch}", "x"))
		if err != nil {
			t.Fatal(err)
		}
		return &target{raw: raw, url: u, host: u.Host}
	}
	cases := []struct {
		kind, url, wantPath, wantType string
		check                         func(t *testing.T, r *http.Request, body []byte)
	}{
		{"nchan", "http://127.0.0.1:1/pub/{ch}", "/pub/bench3", "application/json", func(t *testing.T, r *http.Request, body []byte) {
			if string(body) != string(data) || r.Header.Get("X-EventSource-Event") != "tick" {
				t.Fatalf("body %q, event %q", body, r.Header.Get("X-EventSource-Event"))
			}
		}},
		{"mercure", "http://127.0.0.1:1/.well-known/mercure", "/.well-known/mercure", "application/x-www-form-urlencoded", func(t *testing.T, r *http.Request, body []byte) {
			form, err := url.ParseQuery(string(body))
			if err != nil || form.Get("topic") != "bench3" || form.Get("data") != string(data) || form.Get("type") != "tick" {
				t.Fatalf("form %v (%v)", form, err)
			}
			if r.Header.Get("Authorization") != "Bearer "+hs256JWT("key", `{"mercure":{"publish":["*"]}}`) {
				t.Fatalf("authorization %q", r.Header.Get("Authorization"))
			}
		}},
		{"pushpin", "http://127.0.0.1:1/publish/", "/publish/", "application/json", func(t *testing.T, r *http.Request, body []byte) {
			var got struct {
				Items []struct {
					Channel string
					Formats map[string]map[string]string
				}
			}
			if err := json.Unmarshal(body, &got); err != nil || len(got.Items) != 1 || got.Items[0].Channel != "bench3" ||
				got.Items[0].Formats["http-stream"]["content"] != "event: tick\ndata: "+string(data)+"\n\n" {
				t.Fatalf("body %s (%v)", body, err)
			}
		}},
		{"centrifugo", "http://127.0.0.1:1/api/publish", "/api/publish", "application/json", func(t *testing.T, r *http.Request, body []byte) {
			var got struct {
				Channel string
				Data    json.RawMessage
			}
			if err := json.Unmarshal(body, &got); err != nil || got.Channel != "bench3" || string(got.Data) != string(data) {
				t.Fatalf("body %s (%v)", body, err)
			}
			if r.Header.Get("X-API-Key") != "key" {
				t.Fatalf("API key %q", r.Header.Get("X-API-Key"))
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.kind, func(t *testing.T) {
			p := newRivalPublisher(tc.kind, target(tc.url), "key", 1, time.Second)
			defer p.close()
			r, err := p.request(context.Background(), "bench3", "tick", data)
			if err != nil {
				t.Fatal(err)
			}
			if r.Method != http.MethodPost || r.URL.Path != tc.wantPath || r.Header.Get("Content-Type") != tc.wantType {
				t.Fatalf("%s %s, content type %q", r.Method, r.URL.Path, r.Header.Get("Content-Type"))
			}
			body, _ := io.ReadAll(r.Body)
			tc.check(t, r, body)
		})
	}
}

// Pushpin holds what the GRIP backend answers as a stream of the channel.
func TestGripBackendAnswersWithGripInstructions(t *testing.T) {
	srv := httptest.NewServer(gripHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/stream/bench5")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || resp.Header.Get("Grip-Hold") != "stream" || resp.Header.Get("Grip-Channel") != "bench5" ||
		resp.Header.Get("Content-Type") != "text/event-stream" || string(body) != ": ok\n\n" {
		t.Fatalf("%d %v %q", resp.StatusCode, resp.Header, body)
	}
}

func TestParsePssAndPPID(t *testing.T) {
	pss, err := parsePss([]byte("55d0-7ff [rollup]\nRss:   2048 kB\nPss:   1536 kB\nPss_Anon: 1000 kB\n"))
	if err != nil || pss != 1536 {
		t.Fatalf("Pss %d (%v)", pss, err)
	}
	if _, err := parsePss([]byte("Rss: 1 kB\n")); err == nil {
		t.Fatal("no Pss line: want an error")
	}
	in, ok := parseProcInfo([]byte("42 (a (strange) name) S 17 42 42 0 -1"))
	ppid := in.ppid
	if !ok || ppid != 17 {
		t.Fatalf("ppid %d %v", ppid, ok)
	}
}

// A server of several processes is measured as its whole tree: the
// children are found, and their threads and files are summed in.
func TestProcTreeSumsDescendants(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30 & sleep 30 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	deadline := time.Now().Add(5 * time.Second)
	var kids []int
	for len(kids) < 2 && time.Now().Before(deadline) {
		kids = descendants(cmd.Process.Pid)
		time.Sleep(10 * time.Millisecond)
	}
	if len(kids) < 2 {
		t.Fatalf("descendants of the shell %v, want its two sleeps", kids)
	}
	if !slices.Contains(descendants(os.Getpid()), cmd.Process.Pid) {
		t.Fatal("the shell is not among this process's descendants")
	}
	one, err := readProc(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	tree, err := readProcTree(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if tree.threads < one.threads+2 || tree.fds < one.fds {
		t.Fatalf("tree %+v, the shell alone %+v: the sleeps were not summed in", tree, one)
	}
}
