package caddysse

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/caddy-sse/caddy-sse/internal/h2stall"
)

// dialH2TCPStalled opens an h2c stream of path on a connection it then
// never reads (h2stall).
func dialH2TCPStalled(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	conn, err := h2stall.Dialer().Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h2stall.OpenStream(t, conn, "http", "x", path)
	return conn
}

// An HTTP/2 client that stops reading its connection (TCP, not flow
// control: the reset a passed write deadline sends never goes out) is
// still ended: after slow_client_timeout as a slow client (counted and
// throttled), or within about lastWordsTimeout on a reload. Its stream
// used to stay open for ever — no cut, and a stop that waits for it never
// ended (e2e: a SIGTERM did not exit). A stream on another connection
// gets every event meanwhile.
func TestTCPStalledH2ConnectionIsEnded(t *testing.T) {
	site := `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		slow_client_timeout SLOW
		throttle 30s
		heartbeat 5s
		close_jitter off
		max_event_size 256KiB
		history_bytes 256MiB
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	for _, tc := range []struct{ name, slow string }{{"slow client", "1s"}, {"reload", "30s"}} {
		t.Run(tc.name, func(t *testing.T) {
			site := strings.ReplaceAll(site, "SLOW", tc.slow)
			srv := startCaddy(t, site, h2cGlobals)
			before := metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total")
			healthy := openStream(t, srv.base+"/events?channels=a", nil, h2cClient())
			healthy.comment("ok")
			_ = dialH2TCPStalled(t, "127.0.0.1:"+itoa(srv.port), "/events?channels=a")
			eventually(t, "two streams", func() bool { return metric(t, srv.scrape(), "caddy_sse_streams_open") == 2 })
			payload := strings.Repeat("s", 200<<10)
			for i := range 60 { // 12 MB: more than the sockets' buffers hold
				srv.publish("/events", map[string]any{"channel": "a", "data": itoa(i) + payload})
				if ev := healthy.next(); !strings.HasPrefix(ev.Data, itoa(i)+"s") {
					t.Fatalf("the healthy stream got %.20q, want event %d", ev.Data, i)
				}
			}
			began := time.Now()
			want := 1.0
			if tc.name == "reload" {
				srv.reload(site, h2cGlobals)
				if ev := healthy.next(); ev.Type != "server_closing" {
					t.Fatalf("the healthy stream got %+v", ev)
				}
				healthy.expectEnd()
				want = 0
			}
			deadline := began.Add(6 * time.Second)
			for metric(t, srv.scrape(), "caddy_sse_streams_open") != want {
				if time.Now().After(deadline) {
					t.Fatalf("the stalled HTTP/2 stream is still open %s after the stall", time.Since(began).Round(time.Millisecond))
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("ended %s after the stall", time.Since(began).Round(time.Millisecond))
			if tc.name == "reload" {
				return
			}
			if got := metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total") - before; got != 1 {
				t.Errorf("slow client disconnects went up by %v, want 1", got)
			}
			resp, err := http.Get(srv.base + "/events?channels=a")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusTooManyRequests {
				t.Errorf("the stalled client's address reconnects with %d, want 429 (throttled)", resp.StatusCode)
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
			if ev := healthy.next(); ev.Data != "after" {
				t.Fatalf("the healthy stream got %+v", ev)
			}
		})
	}
}

// throttledReader reads at most chunk bytes a call, each after a pause,
// while slow is set: a client on a slow link.
type throttledReader struct {
	r     io.Reader
	slow  atomic.Bool
	chunk int
	pause time.Duration
}

func (s *throttledReader) Read(p []byte) (int, error) {
	if s.slow.Load() {
		time.Sleep(s.pause)
		p = p[:min(len(p), s.chunk)]
	}
	return s.r.Read(p)
}

// An HTTP/2 connection that is slow but takes bytes (about 160 KiB/s here)
// is not closed when a stream's last words stay in flight past their
// deadline: the reset waits behind the frame of a large response on the
// same connection, whose write waits for room in the full send buffer. The
// stuck-connection guard closed it a second after the deadline, cutting
// the download, which the client was receiving; the stream is reset once
// the frame is through, and the download completes. A client that takes a
// trickle (4 KiB/s) is one that stopped reading, as far as a stop is
// concerned: its connection is closed as before, and the stream ends.
func TestSlowButAliveH2ConnectionIsNotClosed(t *testing.T) {
	dir := t.TempDir()
	const size = 16 << 20
	if err := os.WriteFile(filepath.Join(dir, "big.bin"), bytes.Repeat([]byte("z"), size), 0o644); err != nil {
		t.Fatal(err)
	}
	site := `
:{PORT} {
	metrics /metrics
	handle /big.bin {
		root * ` + dir + `
		file_server
	}
	sse /events {
		channel a
		close_jitter off
	}
}
`
	for _, tc := range []struct {
		name         string
		chunk        int
		pause        time.Duration
		keepDownload bool
	}{
		{"slow link", 16 << 10, 50 * time.Millisecond, true},
		{"trickle", 1 << 10, 250 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startCaddy(t, site, h2cGlobals)
			conn, err := h2stall.Dialer().Dial("tcp", "127.0.0.1:"+itoa(srv.port))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			link := &throttledReader{r: conn, chunk: tc.chunk, pause: tc.pause}
			var wmu sync.Mutex // the framer's writes: the test's and its reader's
			fr := http2.NewFramer(conn, link)
			_, _ = io.WriteString(conn, http2.ClientPreface)
			_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
			_ = fr.WriteWindowUpdate(0, 1<<31-1-65535)
			open := func(id uint32, path string) {
				var buf bytes.Buffer
				enc := hpack.NewEncoder(&buf)
				for _, kv := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", "x"}, {":path", path}} {
					_ = enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
				}
				wmu.Lock()
				defer wmu.Unlock()
				_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: buf.Bytes(), EndStream: true, EndHeaders: true})
			}
			var mu sync.Mutex
			got, ended := map[uint32]int{}, map[uint32]bool{}
			var readErr error
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					f, err := fr.ReadFrame()
					mu.Lock()
					if err != nil {
						readErr = err
						mu.Unlock()
						return
					}
					switch f := f.(type) {
					case *http2.SettingsFrame:
						if !f.IsAck() {
							wmu.Lock()
							_ = fr.WriteSettingsAck()
							wmu.Unlock()
						}
					case *http2.DataFrame:
						got[f.StreamID] += len(f.Data())
						ended[f.StreamID] = ended[f.StreamID] || f.StreamEnded()
					}
					mu.Unlock()
				}
			}()
			open(1, "/events")
			eventually(t, "the stream opens", func() bool { mu.Lock(); defer mu.Unlock(); return got[1] > 0 })
			link.slow.Store(true)
			open(3, "/big.bin")
			time.Sleep(time.Second) // the download fills the send buffer
			began := time.Now()
			srv.reload(site, h2cGlobals)
			if !tc.keepDownload {
				deadline := began.Add(4 * time.Second)
				for metric(t, srv.scrape(), "caddy_sse_streams_open") != 0 {
					if time.Now().After(deadline) {
						t.Fatalf("the stream on a connection that takes a trickle is still open %v after the reload", time.Since(began).Round(time.Millisecond))
					}
					time.Sleep(50 * time.Millisecond)
				}
				return
			}
			time.Sleep(3500 * time.Millisecond) // past the last words' deadline and the guard's grace
			link.slow.Store(false)
			select {
			case <-done:
			case <-time.After(waitFor):
			}
			mu.Lock()
			defer mu.Unlock()
			if !ended[3] || got[3] != size {
				t.Fatalf("the download on the slow connection got %d of %d bytes (ended %v, read: %v): the connection was closed", got[3], size, ended[3], readErr)
			}
		})
	}
}
