package caddysse

import (
	"bytes"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
)

// A reload while a degraded stream recovers from a Redis that hangs on its
// read: Redis answered again (the stream may recover), then stopped
// answering the recovery's history read. The stream is told to close, but
// its read was not interrupted, so it neither said server_closing nor ended
// until go-redis gave up on the read (read_timeout 5 s and 3 retries by
// default: about 20 s), and a stop waited for it (SPEC S8).
func TestReloadDuringADegradedRecoveryFromAHungRedisEndsTheStreamPromptly(t *testing.T) {
	rds := redistest.Start(t)
	proxy := startStallingProxy(t, rds.Addr(), pubsub.FunctionRead, "$3\r\n777\r\n") // the stream's reads alone
	site := redisBlockSite("url redis://"+proxy.addr()+"\n\t\t\tcheck_interval 300ms",
		"replay_limit 777", "heartbeat off", "close_jitter 100ms")
	srv := startCaddy(t, site)

	rds.Kill()
	srv.post("/events", "application/json", []byte(`{"channel":"a","data":"x"}`), nil) // this instance learns Redis is down
	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	proxy.arm()
	rds.Restart()
	rds.WaitShardSubscribers(t, "sse:{a}", 1) // Redis answers this instance again
	rds.WaitFunction(t, pubsub.FunctionPublish)
	rds.MustCLI("FCALL", pubsub.FunctionPublish, "1", "sse:{a}", "", "wake")
	select {
	case <-proxy.stalled:
	case <-time.After(waitFor):
		t.Fatal("the degraded stream never read its history to recover")
	}

	took, closing := reloadUntilTheStreamEnds(t, srv, site, c)
	if took > 3*time.Second || !closing {
		t.Fatalf("a degraded stream told to close while it read the history from a hung Redis ended %v later, server_closing %v (close_jitter 100ms)", took.Round(10*time.Millisecond), closing)
	}
}

// stallingProxy forwards TCP connections to a Redis, but once armed, a
// connection that sends a command holding all of its markers is held: that
// command and everything after it is never forwarded, as if that Redis
// hung for that one connection while it still answers the others. With a
// delay (startDelayingProxy), such a command is held for that long
// instead, then forwarded with what follows it.
type stallingProxy struct {
	*tcpProxy
	markers [][]byte
	delay   time.Duration
	armed   atomic.Bool
	stalled chan struct{} // closed at the first held command
	once    sync.Once
}

func startStallingProxy(t *testing.T, target string, markers ...string) *stallingProxy {
	return startDelayingProxy(t, target, 0, markers...)
}

func startDelayingProxy(t *testing.T, target string, delay time.Duration, markers ...string) *stallingProxy {
	p := &stallingProxy{delay: delay, stalled: make(chan struct{})}
	for _, m := range markers {
		p.markers = append(p.markers, []byte(m))
	}
	p.tcpProxy = startTCPProxy(t, target, p.forward, plainPipe)
	return p
}

func (p *stallingProxy) arm() { p.armed.Store(true) }

// forward copies the client's commands to the server until one holds every
// marker while the proxy is armed; it then reads and drops the rest.
func (p *stallingProxy) forward(client, server net.Conn) {
	defer server.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := client.Read(buf)
		if err != nil {
			return
		}
		if p.armed.Load() && p.holdsMarkers(buf[:n]) {
			p.once.Do(func() { close(p.stalled) })
			if p.delay == 0 {
				_, _ = io.Copy(io.Discard, client)
				return
			}
			time.Sleep(p.delay) // the fault: this connection is slow for a moment
		}
		if _, err := server.Write(buf[:n]); err != nil {
			return
		}
	}
}

func (p *stallingProxy) holdsMarkers(chunk []byte) bool {
	for _, m := range p.markers {
		if !bytes.Contains(chunk, m) {
			return false
		}
	}
	return true
}
