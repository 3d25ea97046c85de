package pubsub

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// channelInSlot finds a channel name whose keys are in slot.
func channelInSlot(t *testing.T, slot int) string {
	t.Helper()
	for i := range 1_000_000 {
		name := "ch" + strconv.Itoa(i)
		if redistest.SlotOf(name) == slot {
			return name
		}
	}
	t.Fatalf("no channel name for slot %d", slot)
	return ""
}

func TestRedisClusterFanOutAndReplay(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs()}
	pub, _ := newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)
	// one channel on each primary's slot range
	channels := []string{channelInSlot(t, 100), channelInSlot(t, 8000), channelInSlot(t, 16000)}
	owners := map[string]bool{}
	for _, c := range channels {
		owners[cluster.NodeOfSlot(t, redistest.SlotOf(c)).Addr()] = true
	}
	if len(owners) != 3 {
		t.Fatalf("channels on %d primaries, want 3", len(owners))
	}
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, channels).Close()
	for _, c := range channels {
		cluster.NodeOfSlot(t, redistest.SlotOf(c)).WaitShardSubscribers(t, "sse:{"+c+"}", 1)
		waitSynced(t, subBroker, c)
	}
	for i := range 10 {
		for _, c := range channels {
			publishTo(t, pub, c, fmt.Sprint(c, "-", i))
		}
	}
	for slot := range channels {
		got := rec.waitFor(t, slot, 10)
		assertContiguous(t, got, 1)
		page, err := sub.Read(context.Background(), channels[slot], &got[4].Pos, 100)
		if err != nil || page.Truncated || len(page.Events) != 5 || page.Events[0].Pos != got[5].Pos {
			t.Fatalf("replay of %s after its 5th event: %+v %v", channels[slot], page, err)
		}
	}
}

// A slot moves to another primary (redis-cli --cluster reshard) while its
// channel is published to: every published event is delivered, in order,
// exactly once, and the channel is subscribed where it lives now.
func TestRedisClusterReshardLosesNothing(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)

	from := cluster.NodeOfSlot(t, 5461)
	// the source hands over its lowest slots first: pick a channel there
	first := cluster.FirstSlotOf(t, from)
	channel := channelInSlot(t, first)
	var to *redistest.Server
	for _, n := range cluster.Nodes {
		if n != from {
			to = n
			break
		}
	}
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, []string{channel}).Close()
	from.WaitShardSubscribers(t, "sse:{"+channel+"}", 1)
	waitSynced(t, subBroker, channel)

	var published []replay.Position
	var mu sync.Mutex
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			pos, err := pub.Publish(context.Background(), channel, Message{Data: []byte(fmt.Sprint(i))}, replay.Limits{Count: 10000, MaxAge: time.Hour, MaxBytes: 16 << 20})
			if err != nil {
				time.Sleep(5 * time.Millisecond) // a refused publish is retried by its backend
				continue
			}
			mu.Lock()
			published = append(published, pos)
			mu.Unlock()
			time.Sleep(time.Millisecond)
		}
	}()
	time.Sleep(200 * time.Millisecond)
	out, err := redistest.CLI(from.Port, "--cluster", "reshard", from.Addr(),
		"--cluster-from", from.NodeID(), "--cluster-to", to.NodeID(), "--cluster-slots", "50", "--cluster-yes")
	if err != nil {
		t.Fatalf("reshard: %v\n%s", err, out)
	}
	cluster.WaitOK(t)
	if owner := cluster.NodeOfSlot(t, first); owner != to {
		t.Fatalf("slot %d is on %s after the reshard, want %s", first, owner.Addr(), to.Addr())
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done
	mu.Lock()
	n := len(published)
	mu.Unlock()
	if n < 50 {
		t.Fatalf("only %d events published", n)
	}
	got := rec.waitFor(t, 0, n)
	assertContiguous(t, got, 1)
	if len(got) != n {
		t.Fatalf("%d delivered, %d published", len(got), n)
	}
	to.WaitShardSubscribers(t, "sse:{"+channel+"}", 1)
	if out, _ := from.CLI("PUBSUB", "SHARDNUMSUB", "sse:{"+channel+"}"); !strings.HasSuffix(out, "0") {
		t.Fatalf("still subscribed on the old primary: %q", out)
	}
}

// Sentinel fails the primary over while events are published: streams
// continue on the new primary; a position lost in the failover is answered
// as truncated, never skipped.
func TestRedisSentinelFailover(t *testing.T) {
	s := redistest.StartSentinel(t)
	opts := RedisOptions{Addrs: []string{s.Sentinel.Addr()}, MasterName: s.Master, CheckInterval: 300 * time.Millisecond,
		DialTimeout: 300 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second}
	pub, _ := newRedisHub(t, opts)
	sub, _ := newRedisHub(t, opts)
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, []string{"f"}).Close()
	s.Primary.WaitShardSubscribers(t, "sse:{f}", 1)
	before := publishTo(t, pub, "f", "before")
	rec.waitFor(t, 0, 1)
	s.Replica.WaitStreamLength(t, "sse:{f}:s", 1)

	s.Primary.Kill()
	deadline := time.Now().Add(30 * time.Second)
	s.WaitFailedOver(t, deadline)
	var after replay.Position
	for {
		pos, err := pub.Publish(context.Background(), "f", Message{Data: []byte("after")}, testLimits)
		if err == nil {
			after = pos
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no publish succeeded after the failover: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	got := rec.waitFor(t, 0, 2)
	if got[1].Pos != after || after.Epoch != before.Epoch || after.Seq != before.Seq+1 {
		t.Fatalf("after the failover: delivered %+v, published %+v, before %+v", got[1].Pos, after, before)
	}
	// a position the new primary never had (lost in the failover) is truncated
	lost := after
	lost.Seq++
	lost.Time--
	page, err := sub.Read(context.Background(), "f", &lost, 10)
	if err != nil || !page.Truncated {
		t.Fatalf("a lost position must be truncated: %+v %v", page, err)
	}
}

// One primary serves many slots, and a cluster refuses (CROSSSLOT) one
// SSUBSCRIBE for shard channels of different slots: a stream on two of its
// channels, and the resubscription of both after the shard's connection
// drops, must each send one command per slot.
func TestRedisClusterChannelsOfManySlotsOnOnePrimary(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs()})
	sub, broker := newRedisHub(t, opts)
	first, a, b := channelInSlot(t, 50), channelInSlot(t, 100), channelInSlot(t, 200)
	node := cluster.NodeOfSlot(t, 50)
	if cluster.NodeOfSlot(t, 100) != node || cluster.NodeOfSlot(t, 200) != node {
		t.Fatal("slots 50, 100 and 200 are not on one primary")
	}
	// a first channel brings the shard's connection up; then one stream
	// subscribes two channels of other slots at once
	defer sub.Subscribe(newRedisRecorder(), []string{first}).Close()
	node.WaitShardSubscribers(t, "sse:{"+first+"}", 1)
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, []string{a, b}).Close()
	for _, c := range []string{a, b} {
		node.WaitShardSubscribers(t, "sse:{"+c+"}", 1)
	}
	publishTo(t, pub, a, "a1")
	publishTo(t, pub, b, "b1")
	rec.waitFor(t, 0, 1)
	rec.waitFor(t, 1, 1)

	node.MustCLI("CLIENT", "KILL", "TYPE", "pubsub") // the shard's connection drops
	for _, c := range []string{first, a, b} {
		node.WaitShardSubscribers(t, "sse:{"+c+"}", 1) // resubscribed, one command per slot
	}
	publishTo(t, pub, a, "a2")
	publishTo(t, pub, b, "b2")
	rec.waitFor(t, 0, 2)
	rec.waitFor(t, 1, 2)
	if !broker.Available() {
		t.Fatal("the broker says Redis is unavailable after resubscribing")
	}
}

// A primary fails and stays down; its replica takes its slots over. The
// dead primary can send no MOVED and no unsubscribe: the channel's
// subscription must still move to the promoted replica, and the events
// published there reach the stream, with what was published before.
func TestRedisClusterFailoverToReplicaOfADeadPrimary(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	primary := cluster.NodeOfSlot(t, 100)
	replica := cluster.AddReplica(t, primary)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond, DialTimeout: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, broker := newRedisHub(t, opts)
	ch := channelInSlot(t, 100)
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, []string{ch}).Close()
	primary.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	publishTo(t, pub, ch, "before")
	rec.waitFor(t, 0, 1)
	if out := primary.MustCLI("WAIT", "1", "5000"); out != "1" {
		t.Fatalf("the replica did not acknowledge the writes: %q", out)
	}

	primary.Kill()
	replica.MustCLI("CLUSTER", "FAILOVER", "TAKEOVER") // the operator promotes it
	var err error
	for deadline := time.Now().Add(redisWait); ; time.Sleep(20 * time.Millisecond) {
		if _, err = pub.Publish(context.Background(), ch, Message{Data: []byte("after")}, testLimits); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishing after the failover: %v", err)
		}
	}
	replica.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	if got := rec.waitFor(t, 0, 2); !strings.Contains(string(got[1].Frame), "after") || got[1].Pos.Seq != got[0].Pos.Seq+1 {
		t.Fatalf("after the failover: %+v then %+v", got[0], got[1])
	}
	pollUntil(t, "the broker to say Redis is available after the failover", broker.Available)
}

// In a cluster whose one primary hangs, publishing to the others goes on:
// the hung primary's stalled publish marks Redis down, but a publish to
// another primary probes its own node, which answers (probes were once one
// for the whole cluster, and a healthy shard's publish was failed by the
// hung one's).
func TestRedisClusterPublishGoesOnWhileOnePrimaryHangs(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), ReadTimeout: 500 * time.Millisecond})
	hung, healthy := channelInSlot(t, 100), channelInSlot(t, 16000)
	publishTo(t, hub, hung, "before")
	publishTo(t, hub, healthy, "before")
	node := cluster.NodeOfSlot(t, redistest.SlotOf(hung))
	node.Pause()
	defer node.Resume()
	go func() { _, _ = hub.Publish(context.Background(), hung, Message{Data: []byte("stalls")}, testLimits) }()
	began := time.Now()
	for broker.Available() {
		if time.Since(began) > 3*time.Second {
			t.Fatal("Redis not marked down by a publish that got no answer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// a publish to the hung primary probes it (the probe waits a read
	// timeout); one to a healthy primary meanwhile probes its own
	go func() { _, _ = hub.Publish(context.Background(), hung, Message{Data: []byte("probes")}, testLimits) }()
	time.Sleep(50 * time.Millisecond) // that probe is under way
	if _, err := hub.Publish(context.Background(), healthy, Message{Data: []byte("goes on")}, testLimits); err != nil {
		t.Fatalf("a publish to a healthy primary while another hangs: %v", err)
	}
}

// A publish answered just before its stall watch fires leaves Redis up: the
// watch may fire between the answer (which marks Redis up) and its stop.
func TestRedisStallWatchAfterTheAnswerLeavesRedisUp(t *testing.T) {
	srv := redistest.Start(t)
	b, err := NewRedis(RedisOptions{Addrs: []string{srv.Addr()}, ReadTimeout: 20 * time.Millisecond}, func(string, *replay.Event) {})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	stop := b.watchStall()
	b.classify(nil) // the call's answer
	for b.Available() {
		time.Sleep(5 * time.Millisecond) // the watch fires
	}
	stop(nil)
	if !b.Available() {
		t.Fatal("Redis left down after a publish that was answered")
	}
}

// The library is loaded lazily on every primary. A primary that is down
// when it is (here at start: the first publish finds it missing) neither
// fails nor holds up a publish to a channel whose slot a healthy primary
// serves (the load on every primary returned the dead one's error, and the
// publish failed with it, marking Redis down), and it gets the library
// once it is back, although no call of caddy-sse lands there: a backend
// publishing straight into Redis (FCALL) needs it.
func TestRedisClusterLibraryLoadWithAPrimaryDown(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		// the healthy primaries go on serving their slots meanwhile
		n.MustCLI("CONFIG", "SET", "cluster-require-full-coverage", "no")
	}
	healthy, elsewhere := channelInSlot(t, 100), channelInSlot(t, 16000)
	down := cluster.NodeOfSlot(t, redistest.SlotOf(elsewhere))
	if down == cluster.NodeOfSlot(t, redistest.SlotOf(healthy)) {
		t.Fatal("the channels are on one primary")
	}
	down.Kill()
	hub, broker := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), DialTimeout: 300 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := hub.Publish(ctx, healthy, Message{Data: []byte("first")}, testLimits); err != nil {
		t.Fatalf("the first publish to a healthy primary while another is down: %v", err)
	}
	if !broker.Available() {
		t.Fatal("Redis marked down by a primary that serves none of the publish's keys")
	}

	// the load on every primary has met the dead one
	pollUntil(t, "the library's load on every primary to end", func() bool { return !broker.sweepingLoads.Load() })

	down.Restart()
	down.WaitFunction(t, FunctionPublish) // loaded on the primary once it was back
	cluster.WaitOK(t)
	publishTo(t, hub, elsewhere, "back")
}
