package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/caddy-sse/caddy-sse/internal/uring"
)

// floorServer is a reference SSE server for measuring the floor of this
// machine, not a product: `ssebench floor-server -addr 127.0.0.1:9090`
// speaks just enough HTTP/1.1 for the scenarios (GET streams, POST
// publishes with the same JSON) and fans an event out by writing one
// chunk per subscriber from the publishing goroutine — one write(2) per
// delivery, no goroutine, buffer, timer or deadline per stream, no replay,
// no auth. Run the same scenario against it (-spawn "ssebench
// floor-server ...") to see what the kernel's loopback TCP and the load
// generator cost by themselves on this box.
type floorServer struct {
	mu   sync.Mutex
	subs map[string][]net.Conn
	seq  int64
	// ring, with -uring, sends an event to every subscriber with one
	// io_uring system call instead of a write(2) each.
	ring  *uring.Ring
	fds   map[net.Conn]int
	sends []uring.IO
}

func runFloorServer(args []string) int {
	fs := flag.NewFlagSet("floor-server", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:9090", "listen address (loopback only)")
	withRing := fs.Bool("uring", false, "send each event to all subscribers with one io_uring system call")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := checkLoopbackAddr(context.Background(), *addr, defaultLookup); err != nil {
		fmt.Fprintln(os.Stderr, "floor-server:", err)
		return 2
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor-server:", err)
		return 1
	}
	s := &floorServer{subs: map[string][]net.Conn{}, fds: map[net.Conn]int{}}
	if *withRing {
		if s.ring, err = uring.New(4096); err != nil {
			fmt.Fprintln(os.Stderr, "floor-server: io_uring:", err)
			return 1
		}
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "floor-server:", err)
			return 1
		}
		go s.serve(c)
	}
}

func (s *floorServer) serve(c net.Conn) {
	br := bufio.NewReaderSize(c, 1024)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			c.Close()
			return
		}
		method, rest, _ := strings.Cut(strings.TrimSpace(line), " ")
		target, _, _ := strings.Cut(rest, " ")
		length := 0
		for {
			h, err := br.ReadString('\n')
			if err != nil {
				c.Close()
				return
			}
			h = strings.TrimSpace(h)
			if h == "" {
				break
			}
			if name, v, ok := strings.Cut(h, ":"); ok && strings.EqualFold(name, "content-length") {
				length, _ = strconv.Atoi(strings.TrimSpace(v))
			}
		}
		switch method {
		case "GET":
			u, err := url.ParseRequestURI(target)
			if err != nil {
				c.Close()
				return
			}
			channel := u.Query().Get("channels")
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+
				chunkOf(": ok\nretry: 3000\n\n")); err != nil {
				c.Close()
				return
			}
			s.mu.Lock()
			s.subs[channel] = append(s.subs[channel], c)
			if raw, err := c.(*net.TCPConn).SyscallConn(); err == nil {
				_ = raw.Control(func(fd uintptr) { s.fds[c] = int(fd) })
			}
			s.mu.Unlock()
			return // no reader: a close is noticed by a failing write
		case "POST":
			body := make([]byte, length)
			if _, err := io.ReadFull(br, body); err != nil {
				c.Close()
				return
			}
			reply, err := s.publish(body)
			status := "200 OK"
			if err != nil {
				status, reply = "400 Bad Request", []byte(`{"error":"json_invalid"}`)
			}
			fmt.Fprintf(c, "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", status, len(reply), reply)
		default:
			c.Close()
			return
		}
	}
}

func chunkOf(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }

func (s *floorServer) publish(body []byte) ([]byte, error) {
	var req struct {
		Channel string          `json:"channel"`
		Event   string          `json:"event"`
		Data    json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(body, &req); err != nil || req.Channel == "" {
		return nil, errors.New("bad request")
	}
	var data bytes.Buffer
	if err := json.Compact(&data, req.Data); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	frame := fmt.Sprintf("event: %s\ndata: %s\nid: %d\n\n", req.Event, data.Bytes(), s.seq)
	chunk := []byte(chunkOf(frame))
	if s.ring != nil {
		s.sendAll(req.Channel, chunk)
		return []byte(fmt.Sprintf(`{"ids":{%q:"%d"}}`, req.Channel, s.seq)), nil
	}
	live := s.subs[req.Channel][:0]
	for _, c := range s.subs[req.Channel] {
		if _, err := c.Write(chunk); err != nil {
			c.Close()
			continue
		}
		live = append(live, c)
	}
	s.subs[req.Channel] = live
	return []byte(fmt.Sprintf(`{"ids":{%q:"%d"}}`, req.Channel, s.seq)), nil
}

// sendAll sends chunk to the channel's subscribers through the ring; what
// a socket did not take at once is written the ordinary way.
func (s *floorServer) sendAll(channel string, chunk []byte) {
	subs := s.subs[channel]
	s.sends = s.sends[:0]
	for _, c := range subs {
		s.sends = append(s.sends, uring.IO{FD: s.fds[c], Buf: chunk})
	}
	failed := map[int]bool{}
	err := s.ring.Submit(s.sends, func(i, n int, err error) {
		if err == nil && n == len(chunk) {
			return
		}
		if errors.Is(err, syscall.EAGAIN) || (err == nil && n < len(chunk)) {
			if _, err := subs[i].Write(chunk[n:]); err == nil {
				return
			}
		}
		failed[i] = true
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor-server: io_uring:", err)
		os.Exit(1)
	}
	live := subs[:0]
	for i, c := range subs {
		if failed[i] {
			c.Close()
			delete(s.fds, c)
			continue
		}
		live = append(live, c)
	}
	s.subs[channel] = live
}
