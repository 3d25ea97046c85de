package pubsub

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/replay"
)

// steadyPublisher publishes to one channel continuously and keeps the
// acknowledged positions, in order.
type steadyPublisher struct {
	mu      sync.Mutex
	acked   []replay.Position
	errs    int
	lastErr error
	lastOK  time.Time
	stop    chan struct{}
	done    chan struct{}
}

func startSteadyPublisher(hub *Hub, channel string) *steadyPublisher {
	p := &steadyPublisher{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for i := 0; ; i++ {
			select {
			case <-p.stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			pos, err := hub.Publish(ctx, channel, Message{Data: []byte(strconv.Itoa(i))}, replay.Limits{Count: 10000, MaxAge: time.Hour, MaxBytes: 16 << 20})
			cancel()
			p.mu.Lock()
			if err != nil {
				p.errs++
				p.lastErr = err
			} else {
				p.acked = append(p.acked, pos)
				p.lastOK = time.Now()
			}
			p.mu.Unlock()
			time.Sleep(2 * time.Millisecond)
		}
	}()
	return p
}

func (p *steadyPublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.acked)
}

// waitMore waits until n more publishes than now were acknowledged.
func (p *steadyPublisher) waitMore(t *testing.T, n int) {
	t.Helper()
	want := p.count() + n
	for deadline := time.Now().Add(redisWait); p.count() < want; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			p.mu.Lock()
			t.Fatalf("only %d publishes acknowledged (%d failed, last: %v), want %d", len(p.acked), p.errs, p.lastErr, want)
		}
	}
}

// waitAttempts waits until n more publishes were attempted, and returns
// how many of them failed and the last error.
func (p *steadyPublisher) waitAttempts(t *testing.T, n int) (failed int, last error) {
	t.Helper()
	p.mu.Lock()
	acked0, errs0 := len(p.acked), p.errs
	p.mu.Unlock()
	for deadline := time.Now().Add(redisWait); ; time.Sleep(5 * time.Millisecond) {
		p.mu.Lock()
		acked, errs, lastErr := len(p.acked), p.errs, p.lastErr
		p.mu.Unlock()
		if acked-acked0+errs-errs0 >= n {
			return errs - errs0, lastErr
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishes stalled: %d attempts", acked-acked0+errs-errs0)
		}
	}
}

func (p *steadyPublisher) finish() []replay.Position {
	close(p.stop)
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]replay.Position(nil), p.acked...)
}

// checkDeliveredExactly checks that the recorder's slot 0 got exactly the
// acknowledged positions, in order, once each.
func checkDeliveredExactly(t *testing.T, rec *redisRecorder, acked []replay.Position) {
	t.Helper()
	deadline := time.Now().Add(redisWait)
	var got []*replay.Event
	for {
		rec.mu.Lock()
		got = append(got[:0], rec.events[0]...)
		rec.mu.Unlock()
		if len(got) >= len(acked) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	delivered := map[replay.Position]int{}
	for _, ev := range got {
		delivered[ev.Pos]++
	}
	var missing, dup []replay.Position
	for _, pos := range acked {
		if delivered[pos] == 0 {
			missing = append(missing, pos)
		}
	}
	for pos, n := range delivered {
		if n > 1 {
			dup = append(dup, pos)
		}
	}
	epochs := map[uint32]int{}
	for _, pos := range acked {
		epochs[pos.Epoch]++
	}
	if len(missing) > 0 || len(dup) > 0 || len(got) != len(acked) {
		show := missing
		if len(show) > 5 {
			show = show[:5]
		}
		t.Fatalf("acknowledged %d publishes (epochs %v), delivered %d: %d acknowledged never delivered (first %+v), %d delivered twice",
			len(acked), epochs, len(got), len(missing), show, len(dup))
	}
	for i := range acked {
		if got[i].Pos != acked[i] {
			t.Fatalf("delivery %d is %+v, publish %d was acknowledged as %+v (disorder)", i, got[i].Pos, i, acked[i])
		}
	}
}

// A slot moves to a primary that has not run a function of the library
// yet (it is loaded lazily, per primary: a primary just added to scale out,
// or one whose channels were not published since it started). A call
// redirected there answers "Function not found": the broker loads the
// library on every primary, not only on the slot's owner. Publishing goes
// on through the resharding.
func TestPublishDuringMigrationToAPrimaryWithoutTheLibrary(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	slot := 100
	channel := channelInSlot(t, slot)
	from := cluster.NodeOfSlot(t, slot)
	to := cluster.OtherPrimary(from)
	publishTo(t, pub, channel, "before")
	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		if phase == "moved" {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := pub.Publish(ctx, channel, Message{Data: []byte(phase)}, testLimits); err != nil {
			t.Errorf("publish while the slot is %s: %v", phase, err)
		}
	})
}

// The slot moves while its channel is published to continuously and
// followed (every primary has the library). Every acknowledged event must
// reach the follower once, in order, in one history; the keys must migrate
// (no second history started on the target) and the subscription must
// follow the slot.
func TestManualSlotMigrationUnderLoad(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		n.MustCLI("FUNCTION", "LOAD", "REPLACE", RedisFunctions())
	}
	pub, rec, slot, channel, key, from, to, _ := followChannelInSlot(t, cluster, 100)

	p := startSteadyPublisher(pub, channel)
	p.waitMore(t, 20)
	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		if failed, err := p.waitAttempts(t, 20); failed > 0 {
			t.Errorf("while the slot is %s: %d of 20 publishes failed, last: %v", phase, failed, err)
		}
	})
	p.waitMore(t, 20)
	acked := p.finish()
	checkDeliveredExactly(t, rec, acked)
	to.WaitShardSubscribers(t, key, 1)
	if out, _ := from.CLI("PUBSUB", "SHARDNUMSUB", key); !strings.HasSuffix(out, "0") {
		t.Fatalf("still subscribed on the old primary: %q", out)
	}
}

// A stream reconnects with its cursor while its channel's slot is
// MIGRATING and the keys are still on the source. The history is all
// there: the replay must be the events after the cursor, not a
// truncation (nor an error): the read declares the channel's keys, so the
// source runs it (with the _v1 read, whose declared key B never exists, it
// went to the target, which has no history yet).
func TestReplayWhileTheSlotIsMigrating(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		n.MustCLI("FUNCTION", "LOAD", "REPLACE", RedisFunctions())
	}
	hub, _ := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond})
	slot := 100
	channel := channelInSlot(t, slot)
	from := cluster.NodeOfSlot(t, slot)
	to := cluster.OtherPrimary(from)
	first := publishTo(t, hub, channel, "1")
	publishTo(t, hub, channel, "2")
	publishTo(t, hub, channel, "3")
	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		if phase != "migrating" {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		page, err := hub.Read(ctx, channel, &first, 100)
		if err != nil || page.Truncated || len(page.Events) != 2 || page.Head.Epoch != first.Epoch {
			t.Errorf("replay after the first event while the slot is migrating: truncated=%v events=%d head=%+v err=%v; want 2 events of epoch %d, not truncated",
				page.Truncated, len(page.Events), page.Head, err, first.Epoch)
		}
	})
}

// One of three primaries hangs (SIGSTOP) while its channel and the
// others' are followed and published to. Publishing to, and delivering on,
// the healthy primaries' channels goes on with bounded latency; a new
// stream's starting point on a healthy channel is read normally; after
// SIGCONT every channel converges.
func TestOneHungPrimaryDoesNotStallTheOthers(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond,
		ReadTimeout: 500 * time.Millisecond, DialTimeout: 500 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, _ := newRedisHub(t, opts)
	hung := channelInSlot(t, 100)
	healthy := []string{channelInSlot(t, 8000), channelInSlot(t, 16000)}
	node := cluster.NodeOfSlot(t, 100)
	for _, c := range healthy {
		if cluster.NodeOfSlot(t, redistest.SlotOf(c)) == node {
			t.Fatal("channels not on three primaries")
		}
	}
	recs := map[string]*redisRecorder{}
	for _, c := range append([]string{hung}, healthy...) {
		recs[c] = newRedisRecorder()
		defer sub.Subscribe(recs[c], []string{c}).Close()
		cluster.NodeOfSlot(t, redistest.SlotOf(c)).WaitShardSubscribers(t, "sse:{"+c+"}", 1)
		publishTo(t, pub, c, "before")
		recs[c].waitFor(t, 0, 1)
	}

	node.Pause()
	resumed := false
	defer func() {
		if !resumed {
			node.Resume()
		}
	}()
	hungPub := startSteadyPublisher(pub, hung) // traffic to the hung shard goes on

	var worstPublish, worstDelivery, worstRead time.Duration
	var failures []string
	healthyAcked := map[string][]replay.Position{}
	for i := 0; i < 40; i++ {
		for _, c := range healthy {
			began := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			pos, err := pub.Publish(ctx, c, Message{Data: []byte(strconv.Itoa(i))}, testLimits)
			cancel()
			worstPublish = max(worstPublish, time.Since(began))
			if err != nil {
				failures = append(failures, fmt.Sprintf("publish %s #%d: %v", c, i, err))
				continue
			}
			healthyAcked[c] = append(healthyAcked[c], pos)
			n := len(healthyAcked[c]) + 1
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
				recs[c].mu.Lock()
				got := len(recs[c].events[0])
				recs[c].mu.Unlock()
				if got >= n {
					break
				}
				if time.Now().After(deadline) {
					failures = append(failures, fmt.Sprintf("event %d of %s not delivered within 5s", n, c))
					break
				}
			}
			worstDelivery = max(worstDelivery, time.Since(began))
			// a new stream on the healthy channel: its starting point
			began = time.Now()
			ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
			_, err = sub.Read(ctx, c, nil, 0)
			cancel()
			worstRead = max(worstRead, time.Since(began))
			if err != nil {
				failures = append(failures, fmt.Sprintf("starting point of a new stream on %s: %v", c, err))
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("while a primary hangs: worst publish %v, worst publish-to-delivery %v, worst head read %v", worstPublish, worstDelivery, worstRead)
	if len(failures) > 0 {
		show := failures
		if len(show) > 8 {
			show = show[:8]
		}
		t.Errorf("%d failures on healthy primaries while one hangs: %s", len(failures), strings.Join(show, "; "))
	}
	const bound = time.Second
	if worstPublish > bound || worstDelivery > bound || worstRead > bound {
		t.Errorf("healthy primaries stalled by a hung one: worst publish %v, delivery %v, head read %v (bound %v)", worstPublish, worstDelivery, worstRead, bound)
	}

	node.Resume()
	resumed = true
	hungPub.waitMore(t, 20) // publishing to it resumes
	acked := hungPub.finish()
	time.Sleep(0)
	// everything the hung channel acknowledged reaches its follower, once
	rec := recs[hung]
	deadline := time.Now().Add(redisWait)
	for {
		rec.mu.Lock()
		got := append([]*replay.Event(nil), rec.events[0]...)
		rec.mu.Unlock()
		delivered := map[replay.Position]int{}
		for _, ev := range got[1:] {
			delivered[ev.Pos]++
		}
		missing, dup := 0, 0
		for _, pos := range acked {
			if delivered[pos] == 0 {
				missing++
			}
		}
		for _, n := range delivered {
			if n > 1 {
				dup++
			}
		}
		if missing == 0 && dup == 0 {
			assertContiguous(t, got, got[0].Pos.Seq)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after SIGCONT: %d acknowledged events of the hung channel never delivered, %d twice (%d acknowledged)", missing, dup, len(acked))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, c := range healthy {
		checkDeliveredExactly(t, &redisRecorder{events: map[int][]*replay.Event{0: recs[c].events[0][1:]}}, healthyAcked[c])
	}
}

// With wait_replicas, a publish runs on a connection of the slot's primary
// (for WAIT), outside the cluster client's redirections. After a slot
// moved, an instance that only publishes to the channel (it follows no
// stream of it, so no unsubscribe tells it) keeps sending the call to the
// old primary, which answers MOVED: the publish must follow the slot, as
// it does without wait_replicas.
func TestWaitReplicasPublishFollowsAMovedSlot(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		n.MustCLI("FUNCTION", "LOAD", "REPLACE", RedisFunctions())
	}
	for _, wait := range []int{0, 1} {
		t.Run(fmt.Sprint("wait_replicas=", wait), func(t *testing.T) {
			slot := 100 + wait
			channel := channelInSlot(t, slot)
			pub, _ := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), WaitReplicas: wait, WaitTimeout: 50 * time.Millisecond})
			publishTo(t, pub, channel, "before")
			from := cluster.NodeOfSlot(t, slot)
			cluster.MigrateSlotByHand(t, slot, from, cluster.OtherPrimary(from), func(string) {})
			// a publisher retries a failed publish; it must not fail for long
			began := time.Now()
			failed := 0
			var first error
			for {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err := pub.Publish(ctx, channel, Message{Data: []byte("after")}, testLimits)
				cancel()
				if err == nil {
					break
				}
				failed++
				if first == nil {
					first = err
				}
				if time.Since(began) > 3*time.Second {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if took := time.Since(began); took > time.Second {
				t.Fatalf("publishing failed for %v after the slot moved (%d failed publishes, first: %v)", took.Round(time.Millisecond), failed, first)
			}
		})
	}
}

// wait_replicas 1 200ms with the only replica frozen, then killed: every
// publish still answers, within about the wait timeout, and the missing
// acknowledgement is logged.
func TestWaitReplicasWithTheReplicaPausedOrKilled(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.Start(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	waitfor.Until(t, "the replica to connect", redisWait, 20*time.Millisecond, func() bool {
		return strings.Contains(replica.MustCLI("INFO", "replication"), "master_link_status:up")
	})
	core, logs := observer.New(zap.WarnLevel)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{primary.Addr()}, WaitReplicas: 1, WaitTimeout: 200 * time.Millisecond,
		ReadTimeout: 500 * time.Millisecond, Logger: zap.New(core)})
	publishTo(t, hub, "w", "acknowledged")
	for _, step := range []struct {
		name string
		do   func()
	}{{"paused", replica.Pause}, {"killed", func() { replica.Resume(); replica.Kill() }}} {
		step.do()
		before := logs.FilterMessage("published event not acknowledged by enough replicas").Len()
		for i := range 3 {
			began := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := hub.Publish(ctx, "w", Message{Data: []byte(step.name)}, testLimits)
			cancel()
			if took := time.Since(began); err != nil || took > time.Second {
				t.Fatalf("replica %s, publish %d: %v after %v", step.name, i, err, took)
			}
		}
		if n := logs.FilterMessage("published event not acknowledged by enough replicas").Len() - before; n != 3 {
			t.Errorf("replica %s: %d warnings for 3 unacknowledged publishes", step.name, n)
		}
		if !broker.Available() {
			t.Errorf("replica %s: the broker says Redis is down", step.name)
		}
	}
}

// A replica takes its primary over gracefully (CLUSTER FAILOVER) while
// the channel is published to continuously and followed: every
// acknowledged event reaches the follower once, in order; publishing
// resumes within a bounded time; the subscription follows the slot.
func TestClusterFailoverUnderLoad(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	slot := 100
	primary := cluster.NodeOfSlot(t, slot)
	replica := cluster.AddReplica(t, primary)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond,
		DialTimeout: 300 * time.Millisecond, ReadTimeout: 500 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)
	channel := channelInSlot(t, slot)
	key := "sse:{" + channel + "}"
	rec := newRedisRecorder()
	defer sub.Subscribe(rec, []string{channel}).Close()
	primary.WaitShardSubscribers(t, key, 1)
	waitSynced(t, subBroker, channel)
	p := startSteadyPublisher(pub, channel)
	p.waitMore(t, 20)
	replica.MustCLI("CLUSTER", "FAILOVER")
	waitfor.Until(t, "the replica to take over", redisWait, 20*time.Millisecond, func() bool {
		return strings.Contains(replica.MustCLI("INFO", "replication"), "role:master")
	})
	failedOver := time.Now()
	p.waitMore(t, 20)
	resumed := time.Since(failedOver)
	acked := p.finish()
	t.Logf("publishing resumed %v after the failover", resumed)
	checkDeliveredExactly(t, rec, acked)
	if resumed > 3*time.Second {
		t.Errorf("20 publishes took %v after the failover", resumed)
	}
	replica.WaitShardSubscribers(t, key, 1)
}

// wait_replicas publishes on one primary's connection (for WAIT), which
// does not follow a reshard as the cluster client does: while the slot is
// migrating (TRYAGAIN for the token's key) and once its keys moved (ASK
// to the target), a publish must still be made, once each, not refused
// (or, with fallback local, delivered to this instance alone).
func TestWaitReplicasPublishesWhileTheSlotMigrates(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), WaitReplicas: 1, WaitTimeout: 50 * time.Millisecond,
		CheckInterval: 300 * time.Millisecond})
	slot := 100
	channel := channelInSlot(t, slot)
	from := cluster.NodeOfSlot(t, slot)
	to := cluster.OtherPrimary(from)
	publishTo(t, hub, channel, "before")
	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := hub.Publish(ctx, channel, Message{Data: []byte(phase)}, testLimits); err != nil {
			t.Errorf("publish while the slot is %s: %v", phase, err)
		}
	})
	if n := to.MustCLI("XLEN", "sse:{"+channel+"}:s"); n != "4" {
		t.Fatalf("the channel holds %s events, want 4", n)
	}
}

// ssubscribes is how many SSUBSCRIBE node has run.
func ssubscribes(node *redistest.Server) int {
	n, _ := strconv.Atoi(strings.TrimPrefix(commandCalls(node.MustCLI("INFO", "commandstats"), "cmdstat_ssubscribe"), "calls="))
	return n
}

// While a followed channel's slot is MIGRATING and its keys are already on
// the target (a reshard under way, or one that stopped half way), the
// check's read of its head is answered ASK. The subscription stays on the
// source, which still owns the slot: it is not dropped and made again in a
// loop as fast as the round trips go (each check answered ASK moved every
// channel of the shard away, and the manager put them back on the same
// primary), and the channel's events still reach the follower.
func TestCheckOfAChannelWhoseKeysMigratedDoesNotResubscribeInALoop(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	pub, rec, slot, channel, _, from, to, _ := followChannelInSlot(t, cluster, 100)
	publishTo(t, pub, channel, "before")
	rec.waitFor(t, 0, 1)

	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		if phase != "migrated" {
			return
		}
		publishTo(t, pub, channel, "migrated")
		before := ssubscribes(from)
		time.Sleep(2 * time.Second) // six check intervals
		if n := ssubscribes(from) - before; n > 3 {
			t.Errorf("%d SSUBSCRIBE on the source in 2 s while the slot's keys are on the target", n)
		}
		rec.waitFor(t, 0, 2)
	})
}

// addEmptyPrimary starts a cluster node that joins cluster as a primary
// without slots, and adds it to cluster.Nodes. It stays a primary when it
// gives its last slot away (not a replica of the node that took it).
func addEmptyPrimary(t *testing.T, cluster *redistest.Cluster) *redistest.Server {
	t.Helper()
	n := redistest.Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
		"--cluster-allow-replica-migration", "no")
	for _, other := range cluster.Nodes {
		n.MustCLI("CLUSTER", "MEET", "127.0.0.1", strconv.Itoa(other.Port))
	}
	id := n.NodeID()
	for _, other := range cluster.Nodes {
		waitfor.Until(t, other.Addr()+" to know the new primary", redisWait, 50*time.Millisecond, func() bool {
			return strings.Contains(other.MustCLI("CLUSTER", "NODES"), id)
		})
	}
	cluster.Nodes = append(cluster.Nodes, n)
	cluster.WaitOK(t)
	return n
}

// A primary that was out of the cluster's slot map for a minute (here it
// gave its slots away; or it failed, its replica took over, and it came
// back as a replica) serves the channel's slot again.
// go-redis closed its client meanwhile (a node out of the cluster's state
// for a minute) and made a new one: the shard of that primary connects
// with the new client. With the closed one it failed to subscribe for
// good, so the channel's events never reached the follower again, and
// every attempt marked Redis down.
func TestShardOfAPrimaryThatServesSlotsAgainAfterAMinute(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for go-redis to close the client of a node out of the cluster for a minute")
	}
	cluster := redistest.StartCluster(t, 3)
	spare := addEmptyPrimary(t, cluster)
	slot := 100
	channel := channelInSlot(t, slot)
	key := "sse:{" + channel + "}"
	home := cluster.NodeOfSlot(t, slot)
	noop := func(string) {}
	cluster.MigrateSlotByHand(t, slot, home, spare, noop)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)
	rec := follow(t, spare, sub, subBroker, channel)
	publishTo(t, pub, channel, "on the spare")
	rec.waitFor(t, 0, 1)

	cluster.MigrateSlotByHand(t, slot, spare, home, noop)
	home.WaitShardSubscribers(t, key, 1)
	publishTo(t, pub, channel, "home")
	rec.waitFor(t, 0, 2)
	time.Sleep(65 * time.Second) // go-redis closes the spare's client

	cluster.MigrateSlotByHand(t, slot, home, spare, noop)
	spare.WaitShardSubscribers(t, key, 1)
	publishTo(t, pub, channel, "on the spare again")
	rec.waitFor(t, 0, 3)
}

// followChannelInSlot makes a publishing hub and a following one on
// cluster, the latter following a channel of slot (synced, its shard
// subscribed on the slot's primary, from), and picks another primary (to)
// for the slot to move to. It returns the channel and its shard channel,
// and the following hub's broker.
func followChannelInSlot(t *testing.T, cluster *redistest.Cluster, slot int) (pub *Hub, rec *redisRecorder, _ int, channel, key string, from, to *redistest.Server, follower *Redis) {
	t.Helper()
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ = newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)
	channel = channelInSlot(t, slot)
	key = "sse:{" + channel + "}"
	from = cluster.NodeOfSlot(t, slot)
	to = cluster.OtherPrimary(from)
	rec = newRedisRecorder()
	t.Cleanup(sub.Subscribe(rec, []string{channel}).Close)
	from.WaitShardSubscribers(t, key, 1)
	waitSynced(t, subBroker, channel)
	return pub, rec, slot, channel, key, from, to, subBroker
}

// channelWithPrefixInSlot is a channel name of slot that starts with prefix.
func channelWithPrefixInSlot(t *testing.T, prefix string, slot int) string {
	t.Helper()
	for i := range 1_000_000 {
		if name := prefix + strconv.Itoa(i); redistest.SlotOf(name) == slot {
			return name
		}
	}
	t.Fatalf("no channel name %q… for slot %d", prefix, slot)
	return ""
}

// A MOVED answers one SSUBSCRIBE as a whole, as a NOPERM does. A shard
// that kept the redirected command among those awaiting replies took
// every later reply for the one before it: the refusal of a refused
// channel's next retry was taken for the redirected command's, so that
// channel was held as asked again for good (never retried, never live
// once granted) and a refusal could be held against a granted channel,
// until the connection was replaced a check interval later.
func TestRefusalAfterAMovedSubscriptionIsHeldAgainstTheRefusedChannel(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		n.MustCLI("ACL", "SETUSER", "app", "reset", "on", ">pw", "~*", "resetchannels", "&sse:{ok*", "+@all")
	}
	from := cluster.NodeOfSlot(t, 0)
	granted := channelWithPrefixInSlot(t, "ok", 0)
	refused := channelWithPrefixInSlot(t, "no", 1)
	moving := channelWithPrefixInSlot(t, "ok", 2)
	if cluster.NodeOfSlot(t, 1) != from || cluster.NodeOfSlot(t, 2) != from {
		t.Fatal("slots 0-2 are not on one primary")
	}
	core, logs := observer.New(zap.DebugLevel)
	// no check interval within the test: the connection is not replaced
	// (unconfirmedTooLong), which would hide the fault
	hub, broker := newRedisHub(t, RedisOptions{Addrs: cluster.Addrs(), Username: "app", Password: "pw",
		CheckInterval: time.Minute, Logger: zap.New(core)})
	t.Cleanup(hub.Subscribe(newRedisRecorder(), []string{granted}).Close)
	t.Cleanup(hub.Subscribe(newRedisRecorder(), []string{refused}).Close)
	waitSynced(t, broker, granted)
	pollUntil(t, "the refused channel to be refused", func() bool { return broker.watch.denied(broker.Key(refused)) })

	// The slot of a channel this instance does not follow yet moves away:
	// its subscription goes to the old primary, which answers MOVED.
	cluster.MigrateSlotByHand(t, 2, from, cluster.OtherPrimary(from), func(string) {})
	refusedAgain := broker.deniedSignal()
	t.Cleanup(hub.Subscribe(newRedisRecorder(), []string{moving}).Close)
	select {
	case <-refusedAgain: // the refused channel, asked again after the move
	case <-time.After(redisWait):
		t.Fatal("no refusal after the move")
	}
	if logs.FilterMessage("a shard channel moved").Len() == 0 {
		t.Fatal("no MOVED: the subscription did not go to the old primary")
	}
	waitSynced(t, broker, moving)
	// Every reply has come (the redirected commands included): none is
	// awaited any more, or the next reply is taken for another command's.
	waitNothingAwaited(t, broker.watch.shardOf(from.Addr()))
	if broker.watch.denied(broker.Key(granted)) {
		t.Errorf("the granted channel is held refused after the move: %v", broker.deniedError())
	}
	if !broker.watch.denied(broker.Key(refused)) {
		t.Error("the refused channel is not held refused after the move")
	}
}

// shardOf is the watcher's shard of the primary at addr.
func (w *watcher) shardOf(addr string) *shard {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.shards[addr]
}

// A slot that moves away takes its own channels to the primary that serves
// it now, and leaves the others of its old primary subscribed: a reshard
// moves slots one by one, and moving every channel of the primary at each
// had it subscribe them all again, slot after slot.
func TestAMovedSlotLeavesTheOtherChannelsOfItsPrimarySubscribed(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sub, subBroker := newRedisHub(t, opts)
	staying, moving := channelInSlot(t, 0), channelInSlot(t, 1)
	from := cluster.NodeOfSlot(t, 0)
	to := cluster.OtherPrimary(from)
	if cluster.NodeOfSlot(t, 1) != from {
		t.Fatal("slots 0 and 1 are not on one primary")
	}
	rec, movingRec := newRedisRecorder(), newRedisRecorder()
	t.Cleanup(sub.Subscribe(rec, []string{staying}).Close)
	t.Cleanup(sub.Subscribe(movingRec, []string{moving}).Close)
	waitSynced(t, subBroker, staying)
	waitSynced(t, subBroker, moving)
	before := ssubscribes(from)

	cluster.MigrateSlotByHand(t, 1, from, to, func(string) {})
	to.WaitShardSubscribers(t, "sse:{"+moving+"}", 1)
	publishTo(t, pub, moving, "moved")
	movingRec.waitFor(t, 0, 1)
	publishTo(t, pub, staying, "stayed")
	rec.waitFor(t, 0, 1)
	if n := ssubscribes(from) - before; n != 0 {
		t.Errorf("the old primary ran %d SSUBSCRIBE after one of its slots moved away", n)
	}
}

// heldShardAfterAMove follows a channel of slot 0 and one of slot 1 of the
// same primary (from) with an ACL user granted the channels "ok…", holds
// the primary's shard's receive loop (a subscriber of the slot 0 channel
// that does not return), and moves slot 1 away: Redis' own unsubscribe of
// the slot 1 channel then waits, unread, for what the test sends next. The
// hold ends with release; leaving is the slot 1 channel's subscription.
func heldShardAfterAMove(t *testing.T) (sub *Hub, broker *Redis, s *shard, leaving *Subscription, release func()) {
	t.Helper()
	cluster := redistest.StartCluster(t, 3)
	for _, n := range cluster.Nodes {
		n.MustCLI("ACL", "SETUSER", "app", "reset", "on", ">pw", "~*", "resetchannels", "&sse:{ok*", "+@all")
	}
	from := cluster.NodeOfSlot(t, 0)
	if cluster.NodeOfSlot(t, 1) != from || cluster.NodeOfSlot(t, 2) != from {
		t.Fatal("slots 0-2 are not on one primary")
	}
	// no check interval within the test: the connection is not replaced
	// (unconfirmedTooLong), which would hide the fault
	opts := RedisOptions{Addrs: cluster.Addrs(), Username: "app", Password: "pw", CheckInterval: time.Minute}
	pub, _ := newRedisHub(t, opts)
	sub, broker = newRedisHub(t, opts)
	held, moving := channelWithPrefixInSlot(t, "ok", 0), channelWithPrefixInSlot(t, "ok", 1)
	blocker := &blockingRecorder{gate: newGate(t)}
	t.Cleanup(sub.Subscribe(blocker, []string{held}).Close)
	t.Cleanup(blocker.openUp) // first: Close waits for the delivery it holds
	leaving = sub.Subscribe(newRedisRecorder(), []string{moving})
	t.Cleanup(leaving.Close)
	waitSynced(t, broker, held)
	waitSynced(t, broker, moving)
	from.WaitShardSubscribers(t, broker.Key(moving), 1)
	s = broker.watch.shardOf(from.Addr())
	publishTo(t, pub, held, "holds the receive loop")
	blocker.waitHeld(t, "the receive loop")
	cluster.MigrateSlotByHand(t, 1, from, cluster.OtherPrimary(from), func(string) {})
	return sub, broker, s, leaving, blocker.openUp
}

// waitSent waits until n commands await replies on s (sent on the wire).
func waitSent(t *testing.T, s *shard, n int) {
	t.Helper()
	for deadline := time.Now().Add(redisWait); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		sent := len(s.sent)
		s.mu.Unlock()
		if sent == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d commands await replies, want %d", sent, n)
		}
	}
}

// waitNothingAwaited waits until s awaits no reply: no command, no
// subscription, no unsubscribe.
func waitNothingAwaited(t *testing.T, s *shard) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		sent, unconfirmed, leaving := slices.Clone(s.sent), s.unconfirmed, len(s.leaving)
		s.mu.Unlock()
		if len(sent) == 0 && unconfirmed == 0 && leaving == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shard awaits replies that will not come: %v (%d subscriptions unconfirmed, %d unsubscribes)", sent, unconfirmed, leaving)
		}
	}
}

// A channel is unsubscribed just after its slot moved away, before the
// shard read Redis' own unsubscribe of it, and another channel is
// subscribed right after. Redis' unsubscribe, the MOVED that answers the
// shard's SUNSUBSCRIBE and the SSUBSCRIBE's answer come in that order: the
// shard took the first for its SUNSUBSCRIBE's reply and the MOVED for the
// SSUBSCRIBE's. A granted channel's confirmation then left the count of
// unconfirmed subscriptions at -1 for the connection's life (a lost
// confirmation is never noticed); a refused channel's refusal answered no
// command any more, and was held against the whole shard: every channel
// of the primary refused and subscribed again on a new connection.
func TestAMovedUnsubscribeAnswersNoLaterSubscription(t *testing.T) {
	for _, next := range []string{"ok", "no"} {
		t.Run(next, func(t *testing.T) {
			sub, broker, s, leaving, release := heldShardAfterAMove(t)
			leaving.Close()
			waitSent(t, s, 1)
			channel := channelWithPrefixInSlot(t, next, 2)
			t.Cleanup(sub.Subscribe(newRedisRecorder(), []string{channel}).Close)
			waitSent(t, s, 2)
			s.mu.Lock()
			ps := s.ps
			s.mu.Unlock()
			release()
			if next == "ok" {
				waitSynced(t, broker, channel)
			} else {
				pollUntil(t, "the refused channel to be held refused", func() bool { return broker.watch.denied(broker.Key(channel)) })
			}
			waitNothingAwaited(t, s)
			s.mu.Lock()
			replaced := s.ps != ps
			s.mu.Unlock()
			if replaced {
				t.Errorf("the shard's connection was replaced (refused: %v)", broker.deniedError())
			}
		})
	}
}

// A refused channel is subscribed just after a slot moved away, and a
// channel of that slot is unsubscribed right after, before the shard read
// Redis' own unsubscribe of it: that unsubscribe comes first, then the
// refusal, then the MOVED that answers the SUNSUBSCRIBE. The shard took
// Redis' unsubscribe for its SUNSUBSCRIBE's reply, which it cannot be
// while an SSUBSCRIBE sent before awaits its answer, and so took the
// refusal for the SUNSUBSCRIBE's: the refused channel was never held
// refused (its new streams waited for a sync that never came) until the
// connection was replaced a check interval later.
func TestASlotsOwnUnsubscribeIsNoReplyWhileAnEarlierCommandIsAwaited(t *testing.T) {
	sub, broker, s, leaving, release := heldShardAfterAMove(t)
	refused := channelWithPrefixInSlot(t, "no", 2)
	t.Cleanup(sub.Subscribe(newRedisRecorder(), []string{refused}).Close)
	waitSent(t, s, 1)
	leaving.Close()
	waitSent(t, s, 2)
	release()
	pollUntil(t, "the refused channel to be held refused", func() bool { return broker.watch.denied(broker.Key(refused)) })
	waitNothingAwaited(t, s)
}

// refusedSSubscribes is how many SSUBSCRIBE node refused (a MOVED).
func refusedSSubscribes(node *redistest.Server) int {
	for _, f := range strings.Split(strings.TrimSpace(commandLine(node.MustCLI("INFO", "commandstats"), "cmdstat_ssubscribe")), ",") {
		if v, ok := strings.CutPrefix(f, "rejected_calls="); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}

// commandLine is a command's line of INFO commandstats.
func commandLine(info, stat string) string {
	for _, line := range strings.Split(info, "\n") {
		if strings.HasPrefix(line, stat+":") {
			return line
		}
	}
	return ""
}

// A followed slot moves away, and the nodes learn it a moment apart (a
// reshard tool tells them in turn, gossip tells the rest): the source
// unsubscribes the channel while the cluster's state go-redis reads, from
// a random node, still names it, or names the target that does not serve
// the slot yet; go-redis reads the state again 200 ms later at the
// soonest. The manager placed the channel where the state said, the
// primary answered MOVED, the shard moved the channel away, and so on in a
// loop as fast as the round trips went: a thousand SSUBSCRIBE refused per
// channel of a moving slot and per instance, in the 200 ms of every move.
func TestAMovedSlotsChannelIsNotPlacedAgainInALoop(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	pub, rec, slot, channel, key, from, to, broker := followChannelInSlot(t, cluster, 100)
	refused := func() int { return refusedSSubscribes(from) + refusedSSubscribes(to) }
	before := refused()
	losses := broker.watch.lookup(key).mark().losses
	slotArg := strconv.Itoa(slot)
	to.MustCLI("CLUSTER", "SETSLOT", slotArg, "IMPORTING", from.NodeID())
	from.MustCLI("CLUSTER", "SETSLOT", slotArg, "MIGRATING", to.NodeID())
	// the channel's epoch, which its watch started, moves as any key does
	keys := strings.Fields(from.MustCLI("CLUSTER", "GETKEYSINSLOT", slotArg, "100"))
	from.MustCLI(append([]string{"MIGRATE", "127.0.0.1", strconv.Itoa(to.Port), "", "0", "5000", "KEYS"}, keys...)...)
	from.MustCLI("CLUSTER", "SETSLOT", slotArg, "NODE", to.NodeID()) // it unsubscribes the channel
	time.Sleep(300 * time.Millisecond)                               // the others are told a moment later
	for _, n := range cluster.Nodes {
		if n != from {
			n.MustCLI("CLUSTER", "SETSLOT", slotArg, "NODE", to.NodeID())
		}
	}
	cluster.WaitOK(t)
	to.WaitShardSubscribers(t, key, 1)
	if losses == broker.watch.lookup(key).mark().losses {
		t.Error("the move was not counted as a lost subscription: a new stream meanwhile started at the last event delivered before it")
	}
	if n := refused() - before; n > 5 {
		t.Errorf("the primaries refused %d SSUBSCRIBE of the channel while the slot moved", n)
	}
	publishTo(t, pub, channel, "moved")
	rec.waitFor(t, 0, 1)
}

// redirectedSlot reads the slot of a MOVED or ASK, and names none for a
// reply it cannot read: the shard then moves every channel, as before.
func TestRedirectedSlot(t *testing.T) {
	for reply, want := range map[string]int{
		"MOVED 2 127.0.0.1:30271":     2,
		"ASK 16383 10.0.0.1:6379":     16383,
		"MOVED 16384 127.0.0.1:30271": -1,
		"MOVED -1 127.0.0.1:30271":    -1,
		"MOVED x 127.0.0.1:30271":     -1,
		"MOVED":                       -1,
	} {
		if got := redirectedSlot(errors.New(reply)); got != want {
			t.Errorf("redirectedSlot(%q) = %d, want %d", reply, got, want)
		}
	}
}
