package caddysse

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"
)

// A goroutine's write to a connection of a stream told to close has at most
// the last-words bound, even when it sets its own (longer) deadline after
// the close hurried the connection: its deadline would otherwise undo the
// hurry, and a stalled client would hold a reload for slow_client_timeout.
func TestConnSinkWriteOfAClosingStreamIsBounded(t *testing.T) {
	sink := closingSinkToStalledClient(t)
	began := time.Now()
	err := sink.writeBy([]byte("event"), time.Now().Add(time.Minute))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write to a stalled client: %v", err)
	}
	if took := time.Since(began); took > lastWordsTimeout+time.Second {
		t.Fatalf("the write of a closing stream took %v (last words %v)", took, lastWordsTimeout)
	}
}

// The hurry of a closing stream's write only ever shortens its deadline:
// a caller's sooner one (slow_client_timeout under 1s) stays.
func TestConnSinkClosingDoesNotExtendAShorterDeadline(t *testing.T) {
	sink := closingSinkToStalledClient(t)
	began := time.Now()
	_ = sink.writeBy([]byte("event"), time.Now().Add(100*time.Millisecond))
	if took := time.Since(began); took > 500*time.Millisecond {
		t.Fatalf("write with a 100ms deadline took %v: the closing bound extended it to lastWordsTimeout", took)
	}
}

// closingSinkToStalledClient is the sink of a stream told to close, whose
// client reads nothing: writes block until their deadline.
func closingSinkToStalledClient(t *testing.T) connSink {
	t.Helper()
	server, client := net.Pipe()
	t.Cleanup(func() {
		_ = server.Close()
		_ = client.Close()
	})
	var closing atomic.Pointer[closeNotice]
	closing.Store(&closeNotice{reason: "reload"})
	return connSink{server, &closing}
}
