package pubsub

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// go-redis' maintenance notifications (a Redis Enterprise feature) are
// off: in their default "auto" mode every new connection asked for them
// (CLIENT MAINT_NOTIFICATIONS), a round trip open-source Redis refuses, and
// the refusal made go-redis write to options shared with the Conns of a
// client without a common lock (a data race the race detector saw on
// publishes with wait_replicas, which use a Conn). Both kinds of
// connection are made here, and none may have asked.
func TestRedisConnectionsDoNotAskForMaintenanceNotifications(t *testing.T) {
	srv := redistest.Start(t)
	for _, opts := range []RedisOptions{
		{Addrs: []string{srv.Addr()}},
		{Addrs: []string{srv.Addr()}, WaitReplicas: 1, WaitTimeout: 50 * time.Millisecond},
	} {
		hub, b := newRedisHub(t, opts)
		sent := &sentBytes{}
		b.client.AddHook(sent)
		publishTo(t, hub, "a", "x") // with wait_replicas, on a Conn of its own
		if sent.contains("maint_notifications") {
			t.Fatalf("a connection asked Redis for maintenance notifications (wait_replicas %d)", opts.WaitReplicas)
		}
		if !sent.contains("sse_publish") {
			t.Fatal("the publish was not seen: the check sees nothing")
		}
	}
}

// sentBytes records what the connections dialed after it was added write.
type sentBytes struct {
	passThrough
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *sentBytes) contains(text string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Contains(bytes.ToLower(s.buf.Bytes()), []byte(text))
}

func (s *sentBytes) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &recordingConn{Conn: conn, to: s}, nil
	}
}

type recordingConn struct {
	net.Conn
	to *sentBytes
}

func (c *recordingConn) Write(p []byte) (int, error) {
	c.to.mu.Lock()
	c.to.buf.Write(p)
	c.to.mu.Unlock()
	return c.Conn.Write(p)
}
