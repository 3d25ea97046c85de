package pubsub

import (
	"bytes"
	"context"
	"net"
	"sync"
	"sync/atomic"
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

// In a cluster, max_retries bounds the copies of a call go-redis sends: its
// cluster client retries (and follows redirects) on its own budget, and
// given max_retries too, its node clients retried each of those attempts
// again — 16 copies with max_retries 3, more than the publish token's life
// (publishOnceTTL) allowed for — while an unset max_retries, which the
// hub's key takes for 3, let the nodes retry nothing. Counted here: the
// attempts that reach a node's client while its primary is frozen.
func TestRedisClusterMaxRetriesBoundsTheAttempts(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	channel := channelInSlot(t, 100)
	frozen := cluster.NodeOfSlot(t, 100)
	for _, retries := range []int{1, -1} {
		opts := RedisOptions{Addrs: cluster.Addrs(), MaxRetries: retries,
			DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond,
			MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 2 * time.Millisecond}
		hub, b := newRedisHub(t, opts)
		attempts := &publishAttempts{}
		b.cluster.OnNewNode(func(node *redis.Client) {
			if node.Options().Addr == frozen.Addr() {
				node.AddHook(attempts)
			}
		})
		publishTo(t, hub, channel, "before") // the node's client exists, its connection pooled
		attempts.n.Store(0)
		frozen.Pause()
		_, err := hub.Publish(context.Background(), channel, Message{Type: "t", Data: []byte("frozen")}, testLimits)
		frozen.Resume()
		if err == nil {
			t.Fatalf("max_retries %d: a publish to a frozen primary succeeded", retries)
		}
		want := int32(max(retries, 1) + 1) // -1 keeps one, for a moved slot to be followed
		if got := attempts.n.Load(); got != want {
			t.Fatalf("max_retries %d: %d attempts reached the frozen primary's client, want %d", retries, got, want)
		}
	}
}

// publishAttempts counts the calls of the library a node's client is
// asked to send (each of them may be retried inside it).
type publishAttempts struct {
	passThrough
	n atomic.Int32
}

func (p *publishAttempts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "fcall" || name == "evalsha" || name == "eval" {
			p.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
