package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakePongRedis answers just enough RESP for a PING (HELLO refused, the
// rest +OK).
func fakePongRedis(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				buf := make([]byte, 4096)
				for {
					n, err := conn.Read(buf)
					if err != nil {
						return
					}
					var out string
					for _, cmd := range strings.Split(string(buf[:n]), "*")[1:] {
						switch u := strings.ToUpper(cmd); {
						case strings.Contains(u, "\r\nHELLO\r\n"):
							out += "-ERR unknown command 'HELLO'\r\n"
						case strings.Contains(u, "\r\nPING\r\n"):
							out += "+PONG\r\n"
						default:
							out += "+OK\r\n"
						}
					}
					if _, err := conn.Write([]byte(out)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return "redis://" + ln.Addr().String()
}

// setup's 10 s context covers resolving the targets, not the Redis check
// that runs after -spawn, which may wait up to -spawn-wait (30 s): a server
// that takes more than 10 s to listen must not make -publish-redis fail
// with "context deadline exceeded" although Redis answers.
func TestPublishRedisAfterSlowSpawn(t *testing.T) {
	if testing.Short() {
		t.Skip("takes 11 s")
	}
	redisURL := fakePongRedis(t)
	ports := freePorts(t, 1)
	script := filepath.Join(t.TempDir(), "slow-server")
	body := fmt.Sprintf("#!/bin/sh\nsleep 10.5\nexec python3 -c 'import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"127.0.0.1\", %d)); s.listen(); time.sleep(30)'\n", ports[0])
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg, err := parseArgs([]string{"idle", "-url", fmt.Sprintf("http://127.0.0.1:%d/events", ports[0]), "-conns", "1", "-q",
		"-spawn", script, "-spawn-wait", "20s", "-publish-redis", redisURL, "-settle", "0", "-ramp-timeout", "300ms", "-head-timeout", "200ms"})
	if err != nil {
		t.Fatal(err)
	}
	// control: the fake Redis answers a PING in time
	opts, err := parseRedisURL(context.Background(), redisURL)
	if err != nil {
		t.Fatal(err)
	}
	ctl := newRedisPublisher(opts, "sse:", 10, 1, time.Second)
	if err := ctl.ping(context.Background()); err != nil {
		t.Fatalf("control ping: %v", err)
	}
	ctl.close()
	r := newRunner(cfg, &strings.Builder{}, &strings.Builder{})
	err = r.setup()
	if r.eng != nil {
		_ = r.eng.closeAll(5 * time.Second)
	}
	r.stopServer()
	if err != nil && strings.Contains(err.Error(), "deadline exceeded") {
		t.Fatalf("setup: %v (the Redis answers PING; the setup context expired during the spawn)", err)
	}
}
