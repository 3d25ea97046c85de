package caddysse

import (
	"net/http"
	"strings"
	"testing"
)

const metricsSite = `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 1
		replay_limit 2
		publish {
			secret ` + testSecret + `
		}
	}
	sse /other {
		channel b
	}
}
`

// The metrics after a scripted scenario, on a real /metrics; they run on
// across a reload.
func TestMetricsAfterScriptedScenario(t *testing.T) {
	srv := startCaddy(t, metricsSite)
	a := srv.subscribe("/events?channels=a&user=u1", nil)
	a.comment("ok")
	var ids []string
	for i := range 3 {
		srv.publish("/events", map[string]any{"channel": "a", "data": itoa(i)})
		ids = append(ids, a.next().ID)
	}
	assertError(t, do(t, http.MethodGet, srv.base+"/events?channels=a&user=u1", nil, ""), 429, "too_many_connections")
	assertError(t, do(t, http.MethodGet, srv.base+"/events?channels=a", nil, ""), 401, "principal_unresolved")
	assertError(t, do(t, http.MethodGet, srv.base+"/events?user=u2", nil, ""), 403, "channel_unresolved")
	b := srv.subscribe("/events?channels=a&user=u2", header("Last-Event-ID", ids[0]))
	b.nextData(2) // replayed
	c := srv.subscribe("/events?channels=a&user=u3", header("Last-Event-ID", "not a cursor"))
	if c.next().Type != "sse_truncated" {
		t.Fatal("want a truncated replay")
	}
	for _, s := range []*sseClient{a, b, c} {
		s.close()
	}
	eventually(t, "the streams to be closed", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_streams_open") == 0
	})

	want := map[string]float64{
		"caddy_sse_streams_open":                                    0,
		"caddy_sse_streams_opened_total":                            3,
		`caddy_sse_rejections_total{reason="too_many_connections"}`: 1,
		`caddy_sse_rejections_total{reason="principal_unresolved"}`: 1,
		`caddy_sse_rejections_total{reason="channel_unresolved"}`:   1,
		`caddy_sse_rejections_total{reason="server_full"}`:          0,
		`caddy_sse_rejections_total{reason="throttled"}`:            0,
		"caddy_sse_events_published_total":                          3,
		"caddy_sse_events_delivered_total":                          5, // 3 live to a, 2 replayed to b
		"caddy_sse_events_replayed_total":                           2,
		"caddy_sse_replays_total":                                   2,
		"caddy_sse_replays_truncated_total":                         1,
		"caddy_sse_events_dropped_total":                            0,
		"caddy_sse_catchups_total":                                  0,
		"caddy_sse_slow_client_disconnects_total":                   0,
		"caddy_sse_delivery_latency_seconds_count":                  3,
		`caddy_sse_delivery_latency_seconds_bucket{le="10"}`:        3,
		"caddy_sse_queue_depth_count":                               3,
		`caddy_sse_queue_depth_bucket{le="1"}`:                      3,
	}
	scrape := srv.scrape()
	for series, value := range want {
		if got := metric(t, scrape, series); got != value {
			t.Errorf("%s = %v, want %v", series, got, value)
		}
	}
	if strings.Contains(scrape, "caddy_sse_redis_") {
		t.Error("Redis metrics are reported without a Redis backend")
	}

	srv.reload(metricsSite)
	if got := metric(t, srv.scrape(), "caddy_sse_streams_opened_total"); got != 3 {
		t.Fatalf("after a reload streams_opened_total = %v, want 3: the counters must run on", got)
	}
	srv.subscribe("/other", nil).comment("ok")
	if got := metric(t, srv.scrape(), "caddy_sse_streams_opened_total"); got != 4 {
		t.Fatalf("streams_opened_total = %v, want 4", got)
	}
}
