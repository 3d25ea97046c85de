package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The README's first command runs Caddyfile.example: the demo page is
// served, a stream opens on the channels of its query, and a publish with
// the demo secret reaches it. The copy run here changes only what a test
// must: the ports (8080 and the admin's 2019 may be taken here) and the
// demo's directory (the test runs elsewhere than the repository's root).
func TestExampleCaddyfileRunsTheDemo(t *testing.T) {
	ex := startExample(t)
	secret, base := ex.secret, fmt.Sprintf("http://127.0.0.1:%d", ex.port)
	client := &http.Client{}

	resp, page := get(t, base+"/")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "<title>caddy-sse demo</title>") {
		t.Fatalf("GET / answered %d, want the demo page:\n%.300s", resp.StatusCode, page)
	}
	c := openStream(t, client, base+"/events?channels=demo", "")
	req, _ := http.NewRequest(http.MethodPost, base+"/events", strings.NewReader(`{"channel":"demo","data":"hello"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+secret)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("publish with the demo secret answered %d", resp.StatusCode)
	}
	ev, err := c.next(time.Now().Add(10 * time.Second))
	if err != nil || ev.Data != "hello" {
		t.Fatalf("the stream got %v (%v), want the published event", ev, err)
	}
}

// startExample runs Caddyfile.example as the README's first command does,
// changing only what a test must: the ports (8080 and the admin's 2019 may
// be taken here) and the demo's directory (the test runs elsewhere than
// the repository's root).
func startExample(t *testing.T) *example {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "Caddyfile.example"))
	if err != nil {
		t.Fatal(err)
	}
	port, admin := freePort(t, false), fmt.Sprintf("127.0.0.1:%d", freePort(t, false))
	caddyfile := string(raw)
	for _, edit := range [][2]string{
		{"admin localhost:2019", "admin " + admin},
		{":8080 {", fmt.Sprintf(":%d {", port)},
		{"root * examples/demo", "root * " + filepath.Join(root, "examples", "demo")},
	} {
		if !strings.Contains(caddyfile, edit[0]) {
			t.Fatalf("Caddyfile.example no longer holds %q: bring this test up to date", edit[0])
		}
		caddyfile = strings.Replace(caddyfile, edit[0], edit[1], 1)
	}
	secret := os.Getenv("SSE_PUBLISH_SECRET") // read when the file is adapted
	if secret == "" {
		secret = "demo-secret" // the file's default, as on a new machine, and the page's
	}
	ex := &example{port: port, secret: secret, admin: admin, caddyfile: caddyfile}
	ex.proc = ex.start(t)
	return ex
}

// example is a running copy of Caddyfile.example.
type example struct {
	proc      *caddyProc
	port      int
	secret    string // the publish secret
	admin     string
	caddyfile string // the copy run
}

// start starts a Caddy of the example's copy (again, after a stop).
func (ex *example) start(t *testing.T) *caddyProc { return startCaddy(t, ex.admin, ex.caddyfile) }
