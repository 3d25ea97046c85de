package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"
)

// The epoll engine on a chunked stream whose CRLF is split across two
// chunks, with the first chunk's framing CRLF read on its own (the decoder
// returns no body bytes, which must not reach the parser as an empty Feed
// that forgets the pending CR). One event whose JSON spans two data: lines
// must arrive whole.
func TestEpollSplitCRLFAcrossChunks(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the epoll engine needs Linux")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		buf := make([]byte, 4096)
		_, _ = conn.Read(buf) // the request
		part1 := `data: {"c":0,"s":1,` + "\r"
		part2 := "\n" + `data: "t":` + fmt.Sprint(monoNow()) + "}\r\n\r\n"
		for _, w := range []string{
			"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x\r\n", len(part1)) + part1,
			"\r\n",
			fmt.Sprintf("%x\r\n", len(part2)) + part2 + "\r\n",
		} {
			if _, err := conn.Write([]byte(w)); err != nil {
				return
			}
			time.Sleep(60 * time.Millisecond)
		}
		time.Sleep(2 * time.Second)
	}()
	tgt, err := resolveTarget(context.Background(), "http://"+ln.Addr().String()+"/events", defaultLookup)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := openEpollEngine(engineOpts{headTimeout: 5 * time.Second, defaultRetry: time.Minute, workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(0, tgt, []int64{0}, []string{"bench0"}, false, 0, eng.shardFor(0))
	eng.start(c)
	time.Sleep(400 * time.Millisecond)
	if err := eng.closeAll(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	tot := eng.core().totals()
	if c.uniq[0].Load() != 1 || tot.foreign != 0 || tot.unparsed != 0 {
		t.Fatalf("distinct events %d, foreign %d, unparsed %d; want 1, 0 and 0 (the CRLF split by an empty Feed cut the event in two)", c.uniq[0].Load(), tot.foreign, tot.unparsed)
	}
}

// cutMidEventServer ends the first stream in the middle of an event's data
// line (a server that closed a slow client, crashed or was force-stopped);
// the reconnection (with Last-Event-ID 1) replays event 2 whole and sends
// event 3. A browser discards the incomplete event at the end of a stream
// (the spec: pending data is discarded at EOF); the client must then count
// 3 distinct events, no duplicate, and no absurd latency.
func cutMidEventServer(t *testing.T) string {
	frame := func(seq int64) string {
		return "event: tick\ndata: " + string(appendBenchData(nil, benchEvent{ch: 0, seq: seq, t: monoNow()}, 0)) +
			fmt.Sprintf("\nid: %d\n\n", seq)
	}
	return serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		if r.Header.Get("Last-Event-ID") == "" {
			fmt.Fprint(w, ": ok\n\n"+frame(1)+`event: tick`+"\n"+`data: {"c":0,"s":2,"t":17`)
			_ = rc.Flush()
			return // the stream ends cleanly, mid-event
		}
		fmt.Fprint(w, ": ok\n\n"+frame(2)+frame(3))
		_ = rc.Flush()
		<-r.Context().Done()
	}))
}

func TestPartialEventDiscardedOnReconnect(t *testing.T) {
	for _, engName := range []string{"std", "epoll"} {
		t.Run(engName, func(t *testing.T) {
			if engName == "epoll" && runtime.GOOS != "linux" {
				t.Skip("the epoll engine needs Linux")
			}
			eng, c := startOneStream(t, engName, cutMidEventServer(t))
			deadline := time.Now().Add(5 * time.Second)
			for (c.uniq[0].Load() < 3 || c.connects.Load() < 2) && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(100 * time.Millisecond)
			if err := eng.closeAll(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			tot := eng.core().totals()
			t.Logf("connects %d uniq %d dupes %d received %d latency max %d ns", c.connects.Load(), c.uniq[0].Load(), tot.dupes, tot.received, tot.lat.Max())
			if c.connects.Load() < 2 || c.uniq[0].Load() != 3 {
				t.Fatalf("connects %d, distinct events %d, want ≥ 2 and 3", c.connects.Load(), c.uniq[0].Load())
			}
			if tot.dupes != 0 || tot.received != 3 {
				t.Errorf("dupes %d received %d, want 0 and 3: the incomplete event of the first stream was merged into the next stream's first dispatch", tot.dupes, tot.received)
			}
			if maxLat := time.Duration(tot.lat.Max()); maxLat > time.Minute {
				t.Errorf("latency max %s: an event was assembled from the cut stream's partial line", maxLat)
			}
		})
	}
}

// An empty body by Content-Length: 0 ends the stream at once, on a
// connection the server keeps open: the epoll engine must end it as the std
// engine (and a browser) does, and reconnect, instead of holding it as a
// live stream that never receives anything.
func TestEpollEmptyContentLengthBodyEndsTheStream(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the epoll engine needs Linux")
	}
	ln, kept := listenKeeping(t)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			kept.keep(conn)                      // kept open: only the body ends
			_, _ = conn.Read(make([]byte, 4096)) // the request
			_, _ = conn.Write([]byte("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 0\r\n\r\n"))
		}
	}()
	tgt, err := resolveTarget(context.Background(), "http://"+ln.Addr().String()+"/events", defaultLookup)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := openEpollEngine(engineOpts{headTimeout: 5 * time.Second, defaultRetry: 20 * time.Millisecond, workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(0, tgt, []int64{0}, []string{"bench0"}, true, 0, eng.shardFor(0))
	eng.start(c)
	deadline := time.Now().Add(3 * time.Second)
	for c.connects.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if err := eng.closeAll(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	k := eng.core()
	if c.connects.Load() < 2 || k.cnt.ended.Load() < 1 {
		t.Fatalf("connects %d, streams ended %d; want ≥ 2 and ≥ 1 (the empty body was held as a live stream)", c.connects.Load(), k.cnt.ended.Load())
	}
}

// keptConns are a test server's connections, held open until the test ends.
type keptConns struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (k *keptConns) keep(c net.Conn) {
	k.mu.Lock()
	k.conns = append(k.conns, c)
	k.mu.Unlock()
}

// listenKeeping listens on loopback; the listener and the connections kept
// are closed when the test ends.
func listenKeeping(t *testing.T) (net.Listener, *keptConns) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	kept := &keptConns{}
	t.Cleanup(func() {
		ln.Close()
		kept.mu.Lock()
		defer kept.mu.Unlock()
		for _, c := range kept.conns {
			c.Close()
		}
	})
	return ln, kept
}

// startOneStream opens one stream of base's /events with the engine named
// (std or epoll): a client of channel 0, retrying 20 ms after a stream ends.
func startOneStream(t *testing.T, engName, base string) (engine, *client) {
	t.Helper()
	tgt, err := resolveTarget(context.Background(), base+"/events", defaultLookup)
	if err != nil {
		t.Fatal(err)
	}
	opts := engineOpts{headTimeout: 5 * time.Second, defaultRetry: 20 * time.Millisecond, workers: 1, readBuf: 1024, proto: "h1"}
	var eng engine
	if engName == "std" {
		eng, err = newStdEngine(opts, []*target{tgt})
	} else {
		eng, err = openEpollEngine(opts)
	}
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(0, tgt, []int64{0}, []string{"bench0"}, true, 0, eng.shardFor(0))
	eng.start(c)
	return eng, c
}
