//go:build linux

package main

import (
	"context"
	"fmt"
	"net"
	"syscall"
	"testing"
	"time"
)

// finWithDataServer answers the first stream with its head and one event
// in the same TCP segment as the FIN (TCP_CORK holds the bytes back until
// the close, which piggybacks the FIN on them): the server ended the
// stream (closed it, crashed, was killed with bytes in its send buffer)
// and the client sees the last bytes and the end in one readiness event.
// Later streams get event 2 and stay open.
func finWithDataServer(t *testing.T, chunked bool) string {
	ln, kept := listenKeeping(t)
	frame := func(seq int64) string {
		return "data: " + string(appendBenchData(nil, benchEvent{ch: 0, seq: seq, t: monoNow()}, 0)) + fmt.Sprintf("\nid: %d\n\n", seq)
	}
	head := "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
	body := func(s string) string { return s }
	if chunked {
		head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
		body = func(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) } // no last chunk: cut
	}
	go func() {
		for n := 0; ; n++ {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			readRequest(conn)
			if n == 0 {
				raw, _ := conn.(*net.TCPConn).SyscallConn()
				_ = raw.Control(func(fd uintptr) {
					_ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_CORK, 1)
				})
				_, _ = conn.Write([]byte(head + body(frame(1))))
				conn.Close()
				continue
			}
			kept.keep(conn)
			_, _ = conn.Write([]byte(head + body(frame(2))))
		}
	}()
	return "http://" + ln.Addr().String()
}

// readRequest reads a request head (so that closing the connection sends
// a FIN, not a reset for unread bytes).
func readRequest(conn net.Conn) {
	var got []byte
	buf := make([]byte, 4096)
	for headEnd(got) < 0 {
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := conn.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			return
		}
	}
}

// The epoll engine reads a socket until a short read, its readiness being
// edge-triggered; a FIN that came with the last bytes is then left unread
// and never reported again: the stream was held as live for good, never
// reconnected, and every later event counted as lost (or, under -chaos
// kill-server, blamed on the server).
func TestEpollEndOfStreamWithTheLastBytes(t *testing.T) {
	for _, tc := range []struct {
		name           string
		chunked, uring bool
	}{{"close-delimited", false, false}, {"chunked-cut", true, false}, {"close-delimited-uring", false, true}, {"chunked-cut-uring", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			tgt, err := resolveTarget(context.Background(), finWithDataServer(t, tc.chunked)+"/events", defaultLookup)
			if err != nil {
				t.Fatal(err)
			}
			eng, err := openEpollEngine(engineOpts{headTimeout: 5 * time.Second, defaultRetry: 20 * time.Millisecond, workers: 1, uring: tc.uring})
			if err != nil {
				t.Fatal(err)
			}
			if tc.uring && eng.name() != "epoll+io_uring" {
				_ = eng.closeAll(5 * time.Second)
				t.Skip("io_uring unavailable here")
			}
			c := newClient(0, tgt, []int64{0}, []string{"bench0"}, true, 0, eng.shardFor(0))
			eng.start(c)
			deadline := time.Now().Add(2 * time.Second)
			for (c.uniq[0].Load() < 2 || c.connects.Load() < 2) && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if err := eng.closeAll(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			k := eng.core()
			if c.connects.Load() < 2 || c.uniq[0].Load() != 2 || k.cnt.ended.Load() < 1 {
				t.Fatalf("connects %d, distinct events %d, streams ended %d; want ≥ 2, 2 and ≥ 1 (the end that came with the last bytes went unseen)",
					c.connects.Load(), c.uniq[0].Load(), k.cnt.ended.Load())
			}
		})
	}
}
