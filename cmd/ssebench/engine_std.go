package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// stdEngine holds streams through net/http's client: one goroutine per
// stream reading the body into a small buffer. It is the engine for TLS and
// HTTP/2 (which the epoll engine does not speak) and a reference for the
// epoll engine's figures. An HTTP/2 target multiplexes streams over few
// connections: opts.h2Conns transports per target, each opening more
// connections only when the server's stream limit is reached.
type stdEngine struct {
	k          *core
	transports [][]*http.Transport // per target
	ctx        context.Context
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

func newStdEngine(opts engineOpts, targets []*target) (*stdEngine, error) {
	shards := 64
	e := &stdEngine{k: newCore(opts, shards)}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	for _, t := range targets {
		n := 1
		if t.tls && opts.proto == "h2" {
			n = max(opts.h2Conns, 1)
		}
		var trs []*http.Transport
		for range n {
			trs = append(trs, e.newTransport(t))
		}
		e.transports = append(e.transports, trs)
	}
	return e, nil
}

func (e *stdEngine) newTransport(t *target) *http.Transport {
	dialer := &net.Dialer{Timeout: e.k.opts.headTimeout}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			d := *dialer
			if src := e.k.nextSrc(); src.IsValid() && t.addr.Addr().Is4() {
				d.LocalAddr = &net.TCPAddr{IP: src.AsSlice()}
			}
			e.k.cnt.dials.Add(1)
			// dial the resolved, checked address, never a re-resolved name
			return d.DialContext(ctx, network, t.addr.String())
		},
		DisableCompression:    true,
		MaxIdleConnsPerHost:   16,
		ResponseHeaderTimeout: e.k.opts.headTimeout,
		TLSHandshakeTimeout:   e.k.opts.headTimeout,
		TLSClientConfig:       insecureTLS(),
	}
	tr.Protocols = new(http.Protocols)
	if t.tls && e.k.opts.proto == "h2" {
		tr.Protocols.SetHTTP2(true)
		// one dial at a time (for HTTP/2 this limits dials, not
		// connections): without it every stream started before the
		// first connection is up dials its own, and net/http closes the
		// surplus (800–900 TLS handshakes for 40 connections)
		tr.MaxConnsPerHost = 1
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	return tr
}

func (e *stdEngine) name() string { return "std" }
func (e *stdEngine) core() *core  { return e.k }

func (e *stdEngine) shardFor(id int) *stats { return e.k.shards[id%len(e.k.shards)] }

func (e *stdEngine) start(c *client) {
	e.wg.Add(1)
	go e.run(c)
}

func (e *stdEngine) closeAll(timeout time.Duration) error {
	e.cancel()
	done := make(chan struct{})
	go func() {
		e.wg.Wait()
		close(done)
	}()
	defer func() {
		for _, trs := range e.transports {
			for _, tr := range trs {
				tr.CloseIdleConnections()
			}
		}
	}()
	select {
	case <-done:
		return nil
	case <-time.After(timeout):
		return errors.New("stream goroutines did not stop in time")
	}
}

func (e *stdEngine) sleep(d time.Duration) bool { return sleepCtx(e.ctx, d) }

// run is one client's life: connect, read the stream, reconnect like a
// browser after it ends, until the engine closes.
func (e *stdEngine) run(c *client) {
	defer e.wg.Done()
	k := e.k
	trs := e.transports[c.tgt.index]
	tr := trs[c.id%len(trs)]
	scheme := "http"
	if c.tgt.tls {
		scheme = "https"
	}
	url := scheme + "://" + c.tgt.host + c.uri
	buf := make([]byte, max(k.opts.readBuf, 256))
	for attempt := 0; ; attempt++ {
		if e.ctx.Err() != nil {
			return
		}
		if attempt > 0 {
			k.cnt.reconnects.Add(1)
		}
		again, stop := e.stream(c, tr, url, buf)
		if stop || !again || !c.reconnect {
			return
		}
		if !e.sleep(c.retryDelay(k.opts.defaultRetry)) {
			return
		}
	}
}

// stream makes one attempt; again is whether a browser would try again,
// stop whether the engine is closing.
func (e *stdEngine) stream(c *client, tr *http.Transport, url string, buf []byte) (again, stop bool) {
	k := e.k
	ctx := e.ctx
	// what an earlier stream cut mid-event left must not join this one
	c.parser.reset()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		k.noteErr("request: " + err.Error())
		return false, false
	}
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Cache-Control", "no-cache")
	req.Header.Set("User-Agent", "ssebench")
	if id := c.lastEventID(); id != "" {
		req.Header.Set("Last-Event-ID", id)
	}
	k.cnt.attempts.Add(1)
	began := time.Now()
	resp, err := tr.RoundTrip(req)
	if err != nil {
		if e.ctx.Err() != nil {
			return false, true
		}
		k.noteErr("connect: " + shortErr(err))
		k.cnt.failed.Add(1)
		return true, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		k.noteErr(fmt.Sprintf("status %d", resp.StatusCode))
		k.cnt.failed.Add(1)
		k.cnt.gaveUp.Add(1)
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return false, false
	}
	now := time.Now()
	k.cnt.connected.Add(1)
	k.cnt.live.Add(1)
	defer k.cnt.live.Add(-1)
	if c.everConnected.CompareAndSwap(false, true) {
		k.cnt.firstConnected.Add(1)
	}
	c.connects.Add(1)
	if resp.Header.Get("X-Replay-Truncated") == "true" {
		k.cnt.truncatedHead.Add(1)
	}
	c.st.mu.Lock()
	c.st.connLat.Record(now.Sub(began).Nanoseconds())
	c.st.mu.Unlock()
	var holdTimer *time.Timer
	if c.hold > 0 {
		body := resp.Body
		holdTimer = time.AfterFunc(c.hold, func() { body.Close() })
		defer holdTimer.Stop()
	}
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if perr := c.feed(buf[:n], monoNow()); perr != nil {
				k.noteErr(perr.Error())
				k.cnt.ended.Add(1)
				return true, false
			}
		}
		if err != nil {
			switch {
			case e.ctx.Err() != nil:
				k.cnt.closedByUs.Add(1)
				return false, true
			case holdTimer != nil && !holdTimer.Stop():
				k.cnt.closedByUs.Add(1)
				return false, false
			case errors.Is(err, io.EOF):
				k.cnt.ended.Add(1)
			default:
				k.noteErr("stream: " + shortErr(err))
				k.cnt.ended.Add(1)
			}
			return true, false
		}
	}
}

// shortErr drops the per-connection detail (addresses) from an error so
// that errors group by kind.
func shortErr(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Op + ": " + op.Err.Error()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "timeout"
	}
	return err.Error()
}
