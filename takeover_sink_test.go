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
	server, client := net.Pipe() // writes block until read: a stalled client
	defer server.Close()
	defer client.Close()
	var closing atomic.Pointer[closeNotice]
	closing.Store(&closeNotice{reason: "reload"})
	sink := connSink{server, &closing}
	began := time.Now()
	err := sink.writeBy([]byte("event"), time.Now().Add(time.Minute))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write to a stalled client: %v", err)
	}
	if took := time.Since(began); took > lastWordsTimeout+time.Second {
		t.Fatalf("the write of a closing stream took %v (last words %v)", took, lastWordsTimeout)
	}
}
