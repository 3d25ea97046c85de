package caddysse

import (
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// startCaddyWithAdmin is startCaddy with Caddy's admin endpoint on a free
// port, whose base URL it returns. The admin server outlives caddy.Stop, so
// a config without it is loaded at the end.
func startCaddyWithAdmin(t *testing.T, sites string) (*testServer, string) {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	srv := startCaddy(t, sites, "admin "+addr)
	t.Cleanup(func() {
		if err := caddy.Load([]byte(`{"admin":{"disabled":true}}`), true); err != nil {
			t.Errorf("closing the admin endpoint: %v", err)
		}
	})
	return srv, "http://" + addr
}

func getStats(t *testing.T, url string) (int, statsReply) {
	t.Helper()
	resp, err := requestClient.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var out statsReply
	if resp.StatusCode == 200 {
		if err := json.Unmarshal(body, &out); err != nil {
			t.Fatalf("stats %q: %v", body, err)
		}
	}
	return resp.StatusCode, out
}

func TestAdminStats(t *testing.T) {
	srv, admin := startCaddyWithAdmin(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		principal {query.user}
		namespace shop
	}
	sse /plain {
		channel {query.channels}
	}
}
`)
	streams := []*sseClient{
		srv.subscribe("/events?channels=a,b&user=u1", nil),
		srv.subscribe("/events?channels=a&user=u1", nil),
		srv.subscribe("/events?channels=a&user=u2", nil),
		srv.subscribe("/plain?channels=c", nil),
	}
	for _, c := range streams {
		c.comment("ok")
	}

	status, got := getStats(t, admin+"/sse/stats")
	want := statsReply{OpenStreams: 4, Hubs: []hubStats{{
		Backend: "embedded", OpenStreams: 4, Channels: 3, Principals: 2,
		TopChannels:   []channelStat{{"shop:a", 3}, {"c", 1}, {"shop:b", 1}},
		TopPrincipals: []principalStat{{Principal: "shop:u1", Streams: 2}, {Principal: "shop:u2", Streams: 1}},
	}}}
	if status != 200 || !reflect.DeepEqual(got, want) {
		t.Fatalf("stats: %d %+v\nwant %+v", status, got, want)
	}

	_, got = getStats(t, admin+"/sse/stats?top=1")
	h := got.Hubs[0]
	if len(h.TopChannels) != 1 || h.TopChannels[0].Channel != "shop:a" || len(h.TopPrincipals) != 1 || h.TopPrincipals[0].Principal != "shop:u1" || h.Channels != 3 {
		t.Fatalf("top=1: %+v", h)
	}
	for _, bad := range []string{"0", "-1", "x", "1001"} {
		if status, _ := getStats(t, admin+"/sse/stats?top="+bad); status != 400 {
			t.Errorf("top=%s: status %d, want 400", bad, status)
		}
	}
	resp, err := requestClient.Post(admin+"/sse/stats", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Errorf("POST: %d, want 405", resp.StatusCode)
	}

	for _, c := range streams {
		c.close()
	}
	eventually(t, "the stats to see the streams closed", func() bool {
		_, got := getStats(t, admin+"/sse/stats")
		h := got.Hubs[0]
		return got.OpenStreams == 0 && h.Channels == 0 && h.Principals == 0 && len(h.TopChannels) == 0
	})
}

// Without ?top the stats name the 10 channels and principals holding the
// most streams (README, "Stats"), not all of them; and no metric label
// names a channel or a principal (README, "Metrics"), on the admin
// endpoint's /metrics either.
func TestAdminStatsTopDefaultsToTenAndMetricsNameNoChannel(t *testing.T) {
	srv, admin := startCaddyWithAdmin(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 1
	}
}
`)
	for i := range 12 {
		srv.subscribe(fmt.Sprintf("/events?channels=chan-xyzzy-%d&user=user-plugh-%d", i, i), nil).comment("ok")
	}
	if got := srv.getRefusal("/events?channels=chan-xyzzy-0&user=user-plugh-0"); got.code != "too_many_connections" {
		t.Fatalf("a refusal to count: %+v", got)
	}
	status, got := getStats(t, admin+"/sse/stats")
	if h := got.Hubs[0]; status != 200 || h.Channels != 12 || h.Principals != 12 || len(h.TopChannels) != 10 || len(h.TopPrincipals) != 10 {
		t.Fatalf("stats without top: %d %+v, want 12 channels and principals, the top 10 of each", status, got)
	}
	resp, err := requestClient.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "caddy_sse_streams_open") {
		t.Fatalf("the admin endpoint's /metrics has no sse metric:\n%.2000s", body)
	}
	if strings.Contains(string(body), "xyzzy") || strings.Contains(string(body), "plugh") {
		t.Fatalf("a metric names a channel or a principal:\n%s", body)
	}
}
