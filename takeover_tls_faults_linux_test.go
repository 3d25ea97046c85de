//go:build linux

package caddysse

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/internal/waitfor"
)

// tlsPair returns the server end of a TLS connection over loopback TCP
// (its TCP connection, and the TLS one) and the client's, handshaken. The
// client's receive buffer is small: a client that does not read soon
// blocks the server's writes.
func tlsPair(t *testing.T) (*net.TCPConn, *tls.Conn, *tls.Conn) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	_ = raw.(*net.TCPConn).SetReadBuffer(4096)
	srvRaw := (<-accepted).(*net.TCPConn)
	_ = srvRaw.SetWriteBuffer(4096)
	srv := tls.Server(srvRaw, &tls.Config{Certificates: []tls.Certificate{cert}})
	cli := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
	done := make(chan error, 1)
	go func() { done <- srv.Handshake() }()
	if err := cli.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close(); srv.Close() })
	return srvRaw, srv, cli
}

// When the loops stop (a stop, or a reload to a config without `writer
// takeover`), endAll ends a TLS stream that is lent to a goroutine and was
// told to close by calling close, which lends it again (closeOnGoroutine): a second
// goroutine then writes its server_closing through the same connWriter and
// TLS connection while the first one still writes its batch. Here the
// first goroutine's write waits for a client that does not read (a catch-up
// from a hung Redis, or a degraded stream's replay read, keeps a goroutine
// as long, beyond the 3 s a stop gives taken-over streams).
func TestLoopStoppingDoesNotLendALentTLSStreamAgain(t *testing.T) {
	l, h := testLoop(t, false), loopTestHandler()
	h.SlowClientTimeout = caddy.Duration(3 * time.Second)
	raw, tc, _ := tlsPair(t)
	fd, err := socketFD(raw)
	if err != nil {
		t.Fatal(err)
	}
	s := newStream(h, []string{"a"})
	l.adopt(s, &tconn{loop: l, fd: int32(fd), tls: tc})
	big := strings.Repeat("x", 16<<10)
	for i := uint64(1); i <= 64; i++ { // 1 MiB: more than the sockets hold
		s.Deliver(0, event(i, i, big))
	}
	batch, _ := s.take()
	l.slow(s, batch, false) // its goroutine blocks writing to the client
	time.Sleep(200 * time.Millisecond)
	s.close(&closeNotice{reason: "shutdown"})
	l.endAll()
	waitfor.Until(t, "the lent stream to end after the loop stopped", 5*time.Second, 5*time.Millisecond, func() bool { return l.count.Load() == 0 })
	time.Sleep(200 * time.Millisecond) // a second goroutine, if any, writes meanwhile
}
