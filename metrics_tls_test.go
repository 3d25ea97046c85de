package caddysse

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Streams over TLS (HTTP/1.1, taken over with writer takeover, and
// HTTP/2), with both writers: delivered events, latency and queue depth
// are counted once per event, and streams_open and /sse/stats go back to 0
// once the clients leave.
func TestTLSStreamsCountedOnceAndReleased(t *testing.T) {
	for _, writer := range []string{"net_http", "takeover"} {
		t.Run(writer, func(t *testing.T) {
			addr := "127.0.0.1:" + itoa(freePort(t))
			port := freePort(t)
			loadCaddyfile(t, `{
	admin `+addr+`
	persist_config off
	local_certs
	skip_install_trust
	auto_https disable_redirects
	http_port `+itoa(freePort(t))+`
	https_port `+itoa(port)+`
	log default {
		output discard
	}
}
https://localhost:`+itoa(port)+` {
	tls internal
	metrics /metrics
	sse /events {
		writer `+writer+`
		channel {query.channels}
		principal {query.user}
		publish {
			secret `+testSecret+`
		}
	}
}
`)
			t.Cleanup(func() { _ = caddy.Stop() })
			t.Cleanup(func() { _ = caddy.Load([]byte(`{"admin":{"disabled":true}}`), true) })
			srv := &testServer{t: t, port: port}
			srv.base = "https://localhost:" + itoa(srv.port)
			tlsConf := &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"}
			var dialer net.Dialer
			dial := func(ctx context.Context, network, _ string) (net.Conn, error) {
				return dialer.DialContext(ctx, network, "127.0.0.1:"+itoa(port))
			}
			h1 := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf.Clone(), DisableCompression: true, DialContext: dial,
				DisableKeepAlives: true, TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{}}}
			h2 := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf.Clone(), DisableCompression: true, DialContext: dial, ForceAttemptHTTP2: true}}
			eventually(t, "the certificate to be issued", func() bool {
				conn, err := tls.Dial("tcp", "127.0.0.1:"+itoa(port), tlsConf)
				if err == nil {
					conn.Close()
				}
				return err == nil
			})
			a := openStream(t, srv.base+"/events?channels=a&user=u1", nil, h1)
			b := openStream(t, srv.base+"/events?channels=a&user=u2", nil, h2)
			if a.resp.StatusCode != 200 || b.resp.StatusCode != 200 {
				t.Fatalf("status %d %d", a.resp.StatusCode, b.resp.StatusCode)
			}
			if b.resp.ProtoMajor != 2 || a.resp.ProtoMajor != 1 {
				t.Fatalf("protocols %s %s", a.resp.Proto, b.resp.Proto)
			}
			a.comment("ok")
			b.comment("ok")
			before := tlsScrape(t, srv, h1)
			_, st := getStats(t, "http://"+addr+"/sse/stats")
			if st.OpenStreams != 2 || len(st.Hubs) != 1 || st.Hubs[0].Principals != 2 {
				t.Fatalf("stats %+v", st)
			}
			pubClient := requestClient
			requestClient = h1
			for i := range 5 {
				srv.publish("/events", map[string]any{"channel": "a", "data": itoa(i)})
			}
			requestClient = pubClient
			a.nextData(5)
			b.nextData(5)
			a.close()
			b.close()
			eventually(t, "streams_open back to 0", func() bool {
				return metric(t, tlsScrape(t, srv, h1), "caddy_sse_streams_open") == 0
			})
			eventually(t, "stats back to 0", func() bool {
				_, st := getStats(t, "http://"+addr+"/sse/stats")
				return st.OpenStreams == 0 && st.Hubs[0].Principals == 0 && st.Hubs[0].Channels == 0
			})
			after := tlsScrape(t, srv, h1)
			for _, s := range []string{"caddy_sse_events_delivered_total", "caddy_sse_delivery_latency_seconds_count"} {
				if got := metric(t, after, s) - metric(t, before, s); got != 10 {
					t.Errorf("%s went up by %v, want 10 (5 events to 2 streams)", s, got)
				}
			}
			if got := metric(t, after, "caddy_sse_streams_opened_total") - metric(t, before, "caddy_sse_streams_opened_total"); got != 0 {
				t.Errorf("streams_opened_total moved by %v", got)
			}
		})
	}
}

func tlsScrape(t *testing.T, srv *testServer, c *http.Client) string {
	t.Helper()
	saved := requestClient
	requestClient = c
	defer func() { requestClient = saved }()
	return srv.scrape()
}
