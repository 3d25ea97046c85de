package main

import (
	"context"
	"errors"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// refusingTransport stands in for http.DefaultTransport: it passes loopback
// requests on and records (never sends) any other.
type refusingTransport struct {
	next http.RoundTripper
	mu   sync.Mutex
	off  []string
}

func (rt *refusingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	host := req.URL.Hostname()
	if a, err := netip.ParseAddr(host); err != nil || !isLoopback(a) {
		rt.mu.Lock()
		rt.off = append(rt.off, req.Method+" "+req.URL.String())
		rt.mu.Unlock()
		return nil, errors.New("refused by the test: not loopback")
	}
	return rt.next.RoundTrip(req)
}

// The admin endpoint is checked to be loopback, but an admin answering
// 302/307 must not send the tool (and, for the reload, the POSTed config)
// to a non-loopback host: its requests follow no redirect (they went
// through http.DefaultClient, which follows them anywhere).
func TestAdminRedirectStaysOnLoopback(t *testing.T) {
	rt := &refusingTransport{next: http.DefaultTransport}
	http.DefaultTransport = rt
	t.Cleanup(func() { http.DefaultTransport = rt.next })
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "http://192.0.2.1:2019"+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	admin := strings.TrimPrefix(base, "http://")
	if err := checkLoopbackAddr(context.Background(), admin, defaultLookup); err != nil {
		t.Fatal(err)
	}
	_ = adminMemStats(admin)
	_ = adminGoroutines(admin)
	cfgFile := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(cfgFile, []byte("secret config\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := newRunner(&config{admin: admin, admins: []string{admin}, configPath: cfgFile, reloadTimeout: 5 * time.Second}, nil, nil)
	if err := r.reload(context.Background()); err == nil || !strings.Contains(err.Error(), "307") {
		t.Errorf("reload: %v, want the 307 reported", err)
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if len(rt.off) > 0 {
		t.Fatalf("requests to non-loopback hosts (redirects followed): %q", rt.off)
	}
}
