package caddysse

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// A refused publish that waits for 100 Continue (curl asks for it above
// 1 MiB) is answered at once, without asking for the body it refuses: the
// refusal read what was left of the body to spare the client a reset, and
// reading it sent 100 Continue, so the client sent megabytes it had
// offered to hold back (curl: 5 MB before its 401), and one that never
// sent them held the handler for good.
func TestARefusalDoesNotAskForTheBodyItRefuses(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	for _, tc := range []struct{ head, status string }{
		{refusedPublish, "401"},
		{"POST /events HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\nAuthorization: Bearer " + testSecret + "\r\n", "415"},
	} {
		_, _, head := rawRequest(t, "127.0.0.1:"+itoa(srv.port), tc.head+"Expect: 100-continue\r\nContent-Length: 8000000\r\n\r\n")
		if !strings.HasPrefix(head, "HTTP/1.1 "+tc.status+" ") {
			t.Fatalf("answered %q, want %s without 100 Continue", head, tc.status)
		}
	}
}

// A refused body sent slowly, a few bytes now and then, is read for
// drainWait at most: it held the handler and its connection for as long
// as the client liked.
func TestARefusedBodySentSlowlyIsNotWaitedFor(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	_, _, head := rawRequest(t, "127.0.0.1:"+itoa(srv.port), refusedPublish+"Content-Length: 1000000\r\n\r\n", trickle)
	if !strings.HasPrefix(head, "HTTP/1.1 401 ") {
		t.Fatalf("answered %q, want 401", head)
	}
}

// A refused body sent fast is read up to maxDrain and no further: the
// client that goes on sending finds its connection closed (reset, as the
// drain's comment says) instead of the server reading all it announced.
func TestARefusedBodyIsReadUpToMaxDrain(t *testing.T) {
	srv := startCaddy(t, rejectSite)
	// far more than maxDrain plus both sockets' buffers (the receiving
	// one grows to tens of MiB on some kernels while it is read)
	const announced = 16 * maxDrain
	conn := sendRaw(t, "127.0.0.1:"+itoa(srv.port), refusedPublish+"Content-Length: "+itoa(announced)+"\r\n\r\n")
	sent, err := io.Copy(conn, io.LimitReader(zeros{}, announced))
	if err == nil {
		t.Fatalf("all %d bytes of the refused body were taken: the drain stops at %d", sent, maxDrain)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("after %d bytes the server neither read more nor closed the connection", sent)
	}
	t.Logf("the connection ended after %d of %d bytes: %v", sent, announced, err)
}

// zeros reads as an endless run of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// On HTTP/2 a refused body is not read at all: the stream ends after the
// answer (RST_STREAM NO_ERROR), so a body sent slowly there cannot hold the
// handler.
func TestARefusedBodyOnHTTP2IsNotRead(t *testing.T) {
	srv := startCaddy(t, rejectSite, h2cGlobals)
	body, sender := io.Pipe()
	defer sender.Close()
	go func() { _, _ = sender.Write([]byte(`{"channel":"a","data":"`)) }() // and nothing more
	ctx, cancel := context.WithTimeout(context.Background(), drainWait+5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.base+"/events", body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header = header("Content-Type", "application/json", "Authorization", "Bearer nope")
	resp, err := h2cClient().Do(req)
	if err != nil {
		t.Fatalf("no answer while the body is being sent: %v", err)
	}
	if resp.ProtoMajor != 2 {
		t.Fatalf("answered over %s, want HTTP/2", resp.Proto)
	}
	assertError(t, resp, http.StatusUnauthorized, "unauthorized")
}

// trickle sends a body slowly: a few bytes every 100 ms until the
// connection closes.
func trickle(conn net.Conn) {
	for {
		time.Sleep(100 * time.Millisecond)
		if _, err := conn.Write([]byte("xxxxx")); err != nil {
			return
		}
	}
}

// refusedPublish is the head of a publish with a wrong secret, but for the
// lines about its body and the blank line.
const refusedPublish = "POST /events HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAuthorization: Bearer nope\r\n"

// The server's read_body timeout, where shorter than drainWait, bounds the
// reading of a refused body too, as the README says: the drain's deadline
// goes through Caddy's response writer, whose body reader keeps the
// handler's hard deadline (read_body) over any later one.
func TestARefusedBodyIsNotReadPastReadBody(t *testing.T) {
	srv := startCaddy(t, rejectSite, "servers {\n\ttimeouts {\n\t\tread_body 200ms\n\t}\n}")
	begun := time.Now()
	conn, r, head := rawRequest(t, "127.0.0.1:"+itoa(srv.port), refusedPublish+"Content-Length: 1000000\r\n\r\n", trickle)
	if !strings.HasPrefix(head, "HTTP/1.1 401 ") {
		t.Fatalf("answered %q, want 401", head)
	}
	_ = conn.SetReadDeadline(time.Now().Add(waitFor))
	_, _ = io.Copy(io.Discard, r) // to the connection's end
	if took := time.Since(begun); took >= drainWait {
		t.Fatalf("the refused body was read for %v: read_body is 200ms", took)
	}
}
