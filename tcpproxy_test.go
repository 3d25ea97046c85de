package caddysse

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// tcpProxy forwards every TCP connection it accepts to target, for tests
// that put a fault between a client and a server (a load balancer cutting
// idle connections, a Redis that hangs for one connection). up copies what
// the client sends to the server and down what the server sends back; each
// returns when its direction is done. The test's cleanup closes the
// listener and every connection.
type tcpProxy struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

// pipe copies one direction of a proxied connection.
type pipe func(from, to net.Conn)

// plainPipe copies everything, then closes the receiving side.
func plainPipe(from, to net.Conn) {
	_, _ = io.Copy(to, from)
	_ = to.Close()
}

func startTCPProxy(t *testing.T, target string, up, down pipe) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{ln: ln}
	var accepting sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		accepting.Wait()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	accepting.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.DialTimeout("tcp", target, 5*time.Second) // bounded: the cleanup waits for this loop
			if err != nil {
				_ = client.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, client, server)
			p.mu.Unlock()
			go up(client, server)
			go down(server, client)
		}
	})
	return p
}

func (p *tcpProxy) addr() string { return p.ln.Addr().String() }

func (p *tcpProxy) url() string { return "http://" + p.addr() }
