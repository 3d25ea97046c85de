package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// protocolsSite: an HTTPS site serving h1, h2 and h3 with every server
// timeout short, `encode gzip zstd`, a `header` directive and the sse
// handler inside `handle_path` (its prefix stripped).
func protocolsSite(t *testing.T, writer string) (*caddyProc, int) {
	t.Helper()
	globals := `servers {
		protocols h1 h2 h3
		timeouts {
			read_body 1s
			read_header 1s
			write 1s
			idle 1s
		}
	}`
	return startTLSCaddy(t, globals, func(port int) string {
		return fmt.Sprintf(`https://localhost:%d {
	tls internal
	encode gzip zstd
	header X-Site yes
	handle_path /api/* {
		sse /events {
			writer %s
			channel {query.channels}
			heartbeat 250ms
			publish {
				secret %s
			}
		}
	}
}
`, port, writer, testSecret)
	})
}

// On every protocol (TLS HTTP/1.1, HTTP/2, HTTP/3) and with both writers:
// behind encode, header and handle_path, with every Caddy server timeout at
// 1 s, a stream is served uncompressed with the stream headers, lives for
// 4 s (heartbeats) and still gets an event; HEAD answers the same status
// and headers without a body; a refusal is the JSON body (SPEC S2).
func TestEveryProtocolBehindEncodeAndTimeouts(t *testing.T) {
	for _, writer := range []string{"net_http", "takeover"} {
		t.Run(writer, func(t *testing.T) {
			_, port := protocolsSite(t, writer)
			h1, base := tlsClient(t, port, false)
			h2, _ := tlsClient(t, port, true)
			h3 := h3Client(t, port)
			base = strings.Replace(base, "/events", "/api/events", 1)
			clients := []*http.Client{h1, h2, h3}
			var streams []*sseConn
			for i, c := range clients {
				s := openTLSStream(t, c, base+"?channels=news", i+1)
				h := s.resp.Header
				if ce := h.Get("Content-Encoding"); ce != "" || s.resp.Uncompressed {
					t.Errorf("HTTP/%d: stream compressed (Content-Encoding %q)", i+1, ce)
				}
				if h.Get("Cache-Control") != "no-store, no-transform" || h.Get("X-Accel-Buffering") != "no" ||
					h.Get("X-Site") != "yes" || h.Get("Content-Length") != "" || s.resp.ContentLength != -1 {
					t.Errorf("HTTP/%d: headers %v (ContentLength %d)", i+1, h, s.resp.ContentLength)
				}
				if i > 0 && len(s.resp.TransferEncoding) > 0 {
					t.Errorf("HTTP/%d: Transfer-Encoding %v", i+1, s.resp.TransferEncoding)
				}
				if s.openRetry < 0 {
					t.Errorf("HTTP/%d: no retry in the preamble", i+1)
				}
				streams = append(streams, s)
			}
			// far beyond every server timeout
			alive := time.NewTimer(4 * time.Second)
			select {
			case <-streams[0].done:
			case <-streams[1].done:
			case <-streams[2].done:
			case <-alive.C:
			}
			for i, s := range streams {
				select {
				case <-s.done:
					t.Fatalf("HTTP/%d stream ended early: %v", i+1, s.err)
				default:
				}
			}
			publish(t, h1, base, testSecret, "news", "late")
			deadline := time.Now().Add(waitFor)
			forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "late") })

			for i, c := range clients {
				req, _ := http.NewRequest(http.MethodHead, base+"?channels=news", nil)
				resp, err := c.Do(req)
				if err != nil {
					t.Fatalf("HTTP/%d HEAD: %v", i+1, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || len(body) != 0 || resp.Header.Get("Content-Type") != "text/event-stream" ||
					resp.Header.Get("Cache-Control") != "no-store, no-transform" || resp.Header.Get("Content-Encoding") != "" {
					t.Errorf("HTTP/%d HEAD: %d %q %v", i+1, resp.StatusCode, body, resp.Header)
				}
				resp, err = c.Get(base)
				if err != nil {
					t.Fatalf("HTTP/%d refused GET: %v", i+1, err)
				}
				body, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				var reply struct{ Error string }
				_ = json.Unmarshal(body, &reply)
				if resp.StatusCode != 403 || reply.Error != "channel_unresolved" || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
					t.Errorf("HTTP/%d refused GET: %d %q %v", i+1, resp.StatusCode, body, resp.Header)
				}
				req, _ = http.NewRequest(http.MethodPut, base+"?channels=news", nil)
				resp, err = c.Do(req)
				if err != nil {
					t.Fatalf("HTTP/%d PUT: %v", i+1, err)
				}
				resp.Body.Close()
				if resp.StatusCode != 405 || resp.Header.Get("Allow") != "GET, HEAD, POST" {
					t.Errorf("HTTP/%d PUT: %d Allow %q", i+1, resp.StatusCode, resp.Header.Get("Allow"))
				}
			}
		})
	}
}

// A stream whose reconnect (its URL with a Last-Event-ID for each of its
// channels) would not fit max_header_size is refused when it opens, as
// each protocol counts a request's headers: 290 channels of 29-byte names
// fit HTTP/1.1 (16 KiB and 4 KiB of slack, raw bytes) but neither HTTP/2
// (16 KiB and 320 bytes, 32 more per field) nor HTTP/3 (16 KiB, counted as
// HTTP/2 counts). HEAD is checked as GET is.
func TestReconnectSizeIsCheckedAsEachProtocolCounts(t *testing.T) {
	_, port := startTLSCaddy(t, "servers {\n\t\tprotocols h1 h2 h3\n\t}", func(port int) string {
		return fmt.Sprintf(`https://localhost:%d {
	tls internal
	sse /events {
		channel {query.channels}
		max_channels 423
	}
}
`, port)
	})
	h1, base := tlsClient(t, port, false)
	h2, _ := tlsClient(t, port, true)
	h3 := h3Client(t, port)
	names := make([]string, 290)
	for i := range names {
		names[i] = fmt.Sprintf("tenant-42:project-%03d:updates", i)
	}
	url := base + "?channels=" + strings.Join(names, ",")
	for i, c := range []*http.Client{h1, h2, h3} {
		resp := headUntilServing(t, c, url)
		resp.Body.Close()
		want := map[int]int{1: 200, 2: 400, 3: 400}[resp.ProtoMajor]
		if resp.ProtoMajor != i+1 || resp.StatusCode != want {
			t.Errorf("HTTP/%d: %d over %s, want %d", i+1, resp.StatusCode, resp.Proto, want)
		}
	}
}

// headUntilServing sends HEAD url until the server answers, retrying while
// it may still be getting its certificate.
func headUntilServing(t *testing.T, client *http.Client, url string) *http.Response {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		req, _ := http.NewRequest(http.MethodHead, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			return resp
		}
		if time.Now().After(deadline) {
			t.Fatalf("HEAD: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
