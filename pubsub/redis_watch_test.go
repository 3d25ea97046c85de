package pubsub

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/replay"
)

// A burst of new streams on channels this instance does not follow yet
// (a ramp, a restart under load) waits for each channel's first sync: the
// shard's check reads the heads (and the newest events) in pipelines, and
// no stream reads its channel's head itself. Each still starts at the
// channel's head and gets every event published after it.
func TestRedisNewStreamsWaitForTheFirstSync(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	// a check interval longer than the test: every read counted below is
	// the first sync's or a stream's own; one pooled connection, as in a
	// ramp where hundreds of streams queue for the pool
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute, PoolSize: 1})
	const channels, perChannel = 40, 3
	heads := make([]replay.Position, channels)
	for c := range channels {
		heads[c] = publishTo(t, pub, "burst-"+strconv.Itoa(c), "before")
	}

	before := fcallROCalls(t, srv)
	type joiner struct {
		channel int
		rec     *redisRecorder
		head    replay.Position
		err     error
	}
	joiners := make([]*joiner, channels*perChannel)
	var wg sync.WaitGroup
	for i := range joiners {
		j := &joiner{channel: i % channels, rec: newRedisRecorder()}
		joiners[i] = j
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := "burst-" + strconv.Itoa(j.channel)
			t.Cleanup(hub.Subscribe(j.rec, []string{name}).Close)
			page, err := hub.Read(context.Background(), name, nil, 100)
			j.head, j.err = page.Head, err
		}()
	}
	wg.Wait()
	// the first sync of each channel: its head, and its newest event (and
	// the heads of a first full check, which may come before the
	// subscriptions are confirmed)
	reads, most := fcallROCalls(t, srv)-before, 2*channels+channels/4
	t.Logf("%d new streams on %d channels: %d reads", len(joiners), channels, reads)
	if reads > most {
		t.Fatalf("%d new streams on %d channels made %d reads, want at most %d (the syncs' own): streams read the head themselves",
			len(joiners), channels, reads, most)
	}
	for i, j := range joiners {
		if j.err != nil || j.head != heads[j.channel] {
			t.Fatalf("joiner %d: head %+v, %v; want %+v", i, j.head, j.err, heads[j.channel])
		}
	}

	const later = 5
	for c := range channels {
		for k := range later {
			publishTo(t, pub, "burst-"+strconv.Itoa(c), fmt.Sprint("after-", k))
		}
	}
	for i, j := range joiners {
		var after []*replay.Event
		deadline := time.Now().Add(redisWait)
		for len(after) < later && time.Now().Before(deadline) {
			got := j.rec.waitFor(t, 0, len(after)+1)
			after = after[:0]
			for _, ev := range got {
				if ev.Pos.Seq > j.head.Seq { // what a stream at head skips as seen
					after = append(after, ev)
				}
			}
		}
		if len(after) != later {
			t.Fatalf("joiner %d got %d events after its head, want %d", i, len(after), later)
		}
		assertContiguous(t, after, j.head.Seq+1)
	}
}

// A stream does not wait for a sync that cannot come: an instance whose
// Redis user may not subscribe to any channel is told so as soon as Redis
// refuses the subscription (the stream opens degraded: its channel cannot
// deliver), and at once once it is known; Redis answers, so it is not
// marked down.
func TestRedisNewStreamDoesNotWaitForARefusedSubscription(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "nochannels", "on", ">secret", "~*", "resetchannels", "+@all")
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	publishTo(t, pub, "orders", "o1")
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, Username: "nochannels", Password: "secret"})
	// the broker answers (so that the wait applies) before the stream
	if _, err := hub.Read(context.Background(), "other", &replay.Position{}, 1); err != nil {
		t.Fatal(err)
	}

	defer hub.Subscribe(newRedisRecorder(), []string{"orders"}).Close()
	for _, when := range []string{"first", "again"} {
		started := time.Now()
		_, err := hub.Read(context.Background(), "orders", nil, 100)
		if !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrSubscribeDenied) {
			t.Fatalf("%s: head of a channel whose subscription Redis refuses: %v", when, err)
		}
		if waited := time.Since(started); waited >= syncWait {
			t.Fatalf("%s: the stream waited %v for a sync that could not come", when, waited)
		}
	}
	if !broker.Available() {
		t.Fatal("Redis marked down by a refused subscription")
	}
}

// A channel whose subscription Redis confirms just before it refuses
// others' (a user granted only some channels: after a refused batch the
// shard subscribes one by one, and the replies come in that order) has its
// first sync at once. The receive loop went on to the next reply after a
// refusal without running the check that was due, so when refusals were
// the last replies of a burst the confirmed channels' first sync waited
// for the next message, or a whole check interval on a quiet connection.
// Forty refused channels: the granted one is answered last only once in
// 41 runs, when the bug does not show.
func TestRedisChannelConfirmedBeforeRefusalsSyncsAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "resetchannels", "&sse:{granted}")
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute, Username: "app", Password: "pw"})
	channels := []string{"granted"}
	for i := range 40 {
		channels = append(channels, fmt.Sprint("refused-", i))
	}
	defer hub.Subscribe(newRedisRecorder(), channels).Close()
	wt := broker.watch.lookup(broker.Key("granted"))
	select {
	case <-wt.ready:
	case <-time.After(3 * time.Second):
		t.Fatal("the granted channel had no first sync within 3 s (check interval: a minute)")
	}
	// the refusals are counted as they come: the granted channel may have
	// been subscribed in a batch of its own, before the others were watched
	for deadline := time.Now().Add(redisWait); broker.watch.countDenied() != 40; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d channels refused, want 40", broker.watch.countDenied())
		}
	}
}

// A wait for a channel's first sync lasts until that sync, whatever other
// channel Redis refuses meanwhile (a user granted only some channels): the
// waits ended at any refusal, when every one was the whole shard's. So the
// throttles' load (synced) read the announcements before its subscription
// was confirmed, and one made meanwhile, if not the newest, was in neither
// that read nor the first sync: the instance admitted that throttled
// client. And a new stream (startAt) read its channel's head itself.
func TestRedisWaitForAFirstSyncOutlastsAnotherChannelsRefusal(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "resetchannels", "&sse:{granted-1}", "&sse:{granted-2}")
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute, Username: "app", Password: "pw"})
	ctx, cancel := context.WithTimeout(context.Background(), redisWait)
	defer cancel()
	defer hub.Subscribe(newRedisRecorder(), []string{"granted-1", "refused-1"}).Close()
	if !broker.watch.synced(ctx, broker.Key("granted-1")) {
		t.Fatal("synced gave up on a granted channel when Redis refused another")
	}
	defer hub.Subscribe(newRedisRecorder(), []string{"granted-2", "refused-2"}).Close()
	if _, ok := broker.watch.startAt(ctx, broker.Key("granted-2")); !ok {
		t.Fatal("a new stream of a granted channel stopped waiting for its first sync when Redis refused another")
	}
	if !broker.watch.denied(broker.Key("refused-1")) || !broker.watch.denied(broker.Key("refused-2")) {
		t.Fatal("the refused channels are not marked refused")
	}
}

// A channel's first sync waits for Redis to confirm its subscription. The
// check every interval read the heads of every channel its shard carried,
// answered or not, and made that its first sync: a stream waiting for it
// went on before Redis had answered the subscription, so a reconnect to a
// channel Redis refuses (an ACL) could replay it as a live one instead of
// opening degraded (a CI run of the module's
// TestRedisStreamWaitingForRefusedChannelsCountsItsReplayOnce), and an
// event published before a subscription took effect went unannounced
// until the next check. A refused channel, never confirmed, shows it: a
// check after the refusal synced it.
func TestRedisFirstSyncWaitsForTheSubscription(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "resetchannels", "&sse:{granted}")
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 20 * time.Millisecond,
		Username: "app", Password: "pw"})
	defer hub.Subscribe(newRedisRecorder(), []string{"granted", "refused"}).Close()
	refused := broker.watch.lookup(broker.Key("refused"))
	pollUntil(t, "the channel's refusal", refused.denied.Load)
	awaitFullChecks(t, broker, 3)
	if refused.isKnown() {
		t.Fatal("a channel whose subscription Redis refused had its first sync")
	}
	if granted := broker.watch.lookup(broker.Key("granted")); !granted.isKnown() {
		t.Fatal("the granted channel had no first sync")
	}
}

// awaitFullChecks waits until n checks of every channel of the broker's
// only shard have begun and ended since it was called.
func awaitFullChecks(t *testing.T, broker *Redis, n int) {
	t.Helper()
	broker.watch.mu.Lock()
	s := broker.watch.shards["main"]
	broker.watch.mu.Unlock()
	for range n {
		s.mu.Lock()
		since := s.lastCheck
		s.mu.Unlock()
		pollUntil(t, "a full check of the shard", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			return s.lastCheck.After(since) && !s.checking
		})
	}
}

// pollUntil polls cond every millisecond until it holds, for at most
// redisWait; what names the wait in the failure.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	waitfor.Until(t, what, redisWait, time.Millisecond, cond)
}

// A refused channel is asked for again every refusedRetry (2 s) on a quiet
// connection too, whatever the check interval: the retries ran only when
// the receive loop woke, at a message or once per check interval (5 s by
// default, a minute here), so an ACL granting the channel took that long
// to take effect, where README promises at most 2 s (as the reconnection
// backoff gave it while a refusal was the whole shard's).
func TestRedisRefusedChannelIsAskedAgainEveryRetryPeriodOnAQuietConnection(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "resetchannels")
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute, Username: "app", Password: "pw"})
	defer hub.Subscribe(newRedisRecorder(), []string{"later"}).Close()
	deadline := time.Now().Add(redisWait)
	for !broker.watch.denied(broker.Key("later")) {
		if time.Now().After(deadline) {
			t.Fatal("the channel was not refused")
		}
		time.Sleep(5 * time.Millisecond)
	}
	srv.MustCLI("ACL", "SETUSER", "app", "&sse:{later}")
	granted := time.Now()
	for !subscribedOnce(t, srv, broker.Key("later")) {
		if time.Since(granted) > 2*refusedRetry+time.Second {
			t.Fatalf("not subscribed %v after the ACL granted the channel (retries every %v)", time.Since(granted), refusedRetry)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// subscribedOnce reports whether Redis has one subscriber of shard channel.
func subscribedOnce(t *testing.T, srv *redistest.Server, channel string) bool {
	t.Helper()
	f := strings.Fields(srv.MustCLI("PUBSUB", "SHARDNUMSUB", channel))
	return len(f) == 2 && f[1] == "1"
}

// fcallROCalls is the number of FCALL_RO calls Redis has run.
func fcallROCalls(t *testing.T, srv *redistest.Server) int {
	t.Helper()
	return commandCount(t, srv, "cmdstat_fcall_ro")
}

// commandCount is the number of calls of a command (its INFO commandstats
// name) Redis has run, those of functions and scripts included; 0 if none.
func commandCount(t *testing.T, srv *redistest.Server, stat string) int {
	t.Helper()
	return commandCounts(t, srv, stat)[0]
}

// commandCounts is commandCount of several commands at one moment (one
// INFO): counts read one after the other drift apart while Redis serves.
func commandCounts(t *testing.T, srv *redistest.Server, stats ...string) []int {
	t.Helper()
	info := srv.MustCLI("INFO", "commandstats")
	counts := make([]int, len(stats))
	for i, stat := range stats {
		calls := commandCalls(info, stat)
		if calls == "" {
			continue
		}
		n, err := strconv.Atoi(strings.TrimPrefix(calls, "calls="))
		if err != nil {
			t.Fatalf("%s: %q", stat, calls)
		}
		counts[i] = n
	}
	return counts
}

// A channel whose last stream leaves and whose next one comes at once is
// unsubscribed and subscribed again; Redis' confirmation of that
// unsubscribe, read after the new subscription was sent, is not taken for
// Redis moving the slot away, which would unsubscribe and subscribe again
// every channel of the shard (losing their announcements meanwhile), and
// again on the confirmations of that.
func TestRedisResubscribingAChannelLeavesTheOthersAlone(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	follow(t, srv, hub, broker, "steady")
	flap := broker.Key("flap")
	sub := hub.Subscribe(newRedisRecorder(), []string{"flap"})
	srv.WaitShardSubscribers(t, flap, 1)
	sh := broker.watch.shards["main"]
	onShard := func(want bool) {
		t.Helper()
		deadline := time.Now().Add(redisWait)
		for {
			sh.mu.Lock()
			_, on := sh.keys[flap]
			sh.mu.Unlock()
			if on == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("flap on the shard: %v, want %v", on, want)
			}
			time.Sleep(time.Millisecond)
		}
	}

	// Redis stopped: the confirmation of the unsubscribe waits until the
	// new subscription has been sent
	before := commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_sunsubscribe")
	srv.Pause()
	sub.Close()
	onShard(false)
	defer hub.Subscribe(newRedisRecorder(), []string{"flap"}).Close()
	onShard(true)
	srv.Resume()

	srv.WaitShardSubscribers(t, flap, 1)
	srv.WaitShardSubscribers(t, broker.Key("steady"), 1)
	// whatever came late has come: a ping after it is answered
	if _, err := hub.Read(context.Background(), "other", &replay.Position{}, 1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // a spurious move would unsubscribe steady within this
	after := commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_sunsubscribe")
	if want := callsPlus(t, before, 1); after != want {
		t.Fatalf("SUNSUBSCRIBE %s after one channel's unsubscribe (%s before): the shard moved its channels away", after, before)
	}
}

// callsPlus adds n to a commandstats "calls=N" figure.
func callsPlus(t *testing.T, calls string, n int) string {
	t.Helper()
	c, err := strconv.Atoi(strings.TrimPrefix(calls, "calls="))
	if calls == "" {
		c, err = 0, nil
	}
	if err != nil {
		t.Fatalf("calls: %q", calls)
	}
	return "calls=" + strconv.Itoa(c+n)
}

// A channel whose last subscriber leaves and whose next one comes before
// the manager applied the unwatch keeps its Redis subscription (attach
// finds the key still on the shard) and only queues the new watch's first
// sync; nothing made the shard's receive loop run it, so on a quiet shard
// the new stream waited the whole syncWait and then read the head itself.
func TestRedisRewatchedChannelIsSyncedAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	slow := 0
	const rounds = 10
	for i := range rounds {
		ch := "flap-" + strconv.Itoa(i)
		publishTo(t, hub, ch, "x")
		sub := hub.Subscribe(newRedisRecorder(), []string{ch})
		srv.WaitShardSubscribers(t, broker.Key(ch), 1)
		waitSynced(t, broker, ch)
		sub.Close() // the last subscriber leaves, the next comes at once
		sub = hub.Subscribe(newRedisRecorder(), []string{ch})
		defer sub.Close()
		started := time.Now()
		if _, err := hub.Read(context.Background(), ch, nil, 100); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(started); took > syncWait/2 {
			slow++
			t.Logf("round %d: the new stream's start took %v", i, took)
		}
	}
	if slow > 0 {
		t.Fatalf("%d of %d new streams of a channel watched again at once waited for a sync that did not come", slow, rounds)
	}
}

// A watch stays known while its pub/sub connection is down: until the new
// subscription is confirmed and checked, a new stream (a Read without a
// position: startAt) starts at the last position the watch delivered
// before the connection broke, behind the channel's head, and is later
// handed the events published before it joined (SPEC S4: a fresh
// connection starts live, no replay).
func TestRedisNewStreamWhileResubscribingStartsAtTheHead(t *testing.T) {
	srv := redistest.Start(t)
	other, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	rec := follow(t, srv, hub, broker, "orders")
	publishTo(t, other, "orders", "o1")
	rec.waitFor(t, 0, 1)

	// A round counts if the shard was still reconnecting when the stream
	// read its start: once it has resubscribed and synced, the watch may
	// answer before this instance's own publish is announced (the stream
	// then gets that event live), which is not what this test is about.
	// On a loaded machine (CI runs three test processes on two cores) the
	// publishes and the read often outlast the shard's 50 ms reconnection
	// wait (3 rounds of 20 counted once): there are rounds to spare.
	stale, counted := 0, 0
	const rounds = 5
	for round := 0; counted < rounds; round++ {
		if round == 20*rounds {
			t.Fatalf("only %d of %d rounds read while the shard was reconnecting", counted, round)
		}
		reconnects := broker.BackendStatus().Reconnects
		srv.MustCLI("CLIENT", "KILL", "TYPE", "pubsub")
		waitBehind(t, broker, "orders") // the shard noticed: it waits 50 ms to reconnect
		publishTo(t, other, "orders", fmt.Sprint("missed-", round))
		head := publishTo(t, hub, "orders", fmt.Sprint("own-", round)) // this instance publishes too
		sub := hub.Subscribe(newRedisRecorder(), []string{"orders"})
		page, err := hub.Read(context.Background(), "orders", nil, 100)
		if err != nil {
			t.Fatal(err)
		}
		if broker.BackendStatus().Reconnects == reconnects {
			counted++
			if page.Head != head {
				stale++
				t.Logf("round %d: a new stream starts at seq %d; the channel's head is seq %d", round, page.Head.Seq, head.Seq)
			}
		}
		sub.Close()
		srv.WaitShardSubscribers(t, broker.Key("orders"), 1)
		waitDelivered(t, broker, "orders", head)
	}
	if stale > 0 {
		t.Fatalf("%d of %d new streams started behind the channel's head", stale, rounds)
	}
}

// waitBehind waits until the watch of channel knows that its pub/sub
// connection ended (behind: no check has compared the head since).
func waitBehind(t *testing.T, broker *Redis, channel string) {
	t.Helper()
	wt := broker.watch.lookup(broker.Key(channel))
	pollUntil(t, "the watch of "+channel+" to notice that its pub/sub connection was killed", func() bool {
		wt.mu.RLock()
		defer wt.mu.RUnlock()
		return wt.behind
	})
}

func waitDelivered(t *testing.T, broker *Redis, channel string, at replay.Position) {
	t.Helper()
	deadline := time.Now().Add(redisWait)
	for {
		if last, ok := broker.watch.delivered(broker.Key(channel)); ok && last == at {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watch of %s did not catch up with %+v", channel, at)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rewriteFrom replaces the events of channel from seq from on as a
// failover that lost them leaves its history once new events took their
// seqs: datas are the new events (later times, the same seqs), written
// without announcing them (announced while this instance was not
// subscribed), and the channel's head is the last of them.
func rewriteFrom(t *testing.T, srv *redistest.Server, channel string, lost []replay.Position, datas ...string) {
	t.Helper()
	key := "sse:{" + channel + "}"
	for _, pos := range lost {
		srv.MustCLI("XDEL", key+":s", fmt.Sprintf("%d-%d", pos.Time, pos.Seq))
	}
	time.Sleep(5 * time.Millisecond) // later times than the lost events'
	seq := lost[0].Seq
	for i, data := range datas {
		now := time.Now().UnixMilli() + int64(i)
		srv.MustCLI("XADD", key+":s", fmt.Sprintf("%d-%d", now, seq), "y", "t", "d", data)
		srv.MustCLI("HSET", key+":m", "s", strconv.FormatUint(seq, 10), "t", strconv.FormatInt(now, 10))
		seq++
	}
}

// A channel's history was rewritten (a failover lost events and gave
// their seqs to new ones) and the first of the new events this instance
// hears of is announced after others it missed. Its seq does not tell: it
// may follow the last delivered seq, or contradict it. The watch reads
// the history before it, so that the missed events are delivered first
// (streams that wrote a lost event end at the first of them, and are told
// on reconnect); it delivered the announced event at once, and no stream
// got the ones before it.
func TestRedisRewrittenHistoryIsReadBeforeTheAnnouncedEvent(t *testing.T) {
	srv := redistest.Start(t)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Hour} // no check repairs it
	pub, _ := newRedisHub(t, opts)
	sub, broker := newRedisHub(t, opts)

	t.Run("subscription lost, the announced event follows the lost one", func(t *testing.T) {
		rec := follow(t, srv, sub, broker, "a")
		publishTo(t, pub, "a", "1")
		lost := publishTo(t, pub, "a", "lost")
		rec.waitFor(t, 0, 2)
		// the shard's connection ended (the primary failed): not checked since
		broker.watch.lookup(broker.Key("a")).lostSubscription()
		rewriteFrom(t, srv, "a", []replay.Position{lost}, "2")
		publishTo(t, pub, "a", "3")
		got := rec.waitFor(t, 0, 4)
		if dataOf(got[2]) != "2" || got[2].Pos.Seq != 2 || dataOf(got[3]) != "3" {
			t.Fatalf("after the rewrite: %q %+v, %q %+v", dataOf(got[2]), got[2].Pos, dataOf(got[3]), got[3].Pos)
		}
	})
	t.Run("the announced event contradicts the last delivered", func(t *testing.T) {
		rec := follow(t, srv, sub, broker, "b")
		publishTo(t, pub, "b", "1")
		lost2 := publishTo(t, pub, "b", "lost")
		lost3 := publishTo(t, pub, "b", "lost too")
		rec.waitFor(t, 0, 3)
		rewriteFrom(t, srv, "b", []replay.Position{lost2, lost3}, "2")
		publishTo(t, pub, "b", "3")
		got := rec.waitFor(t, 0, 5)
		if dataOf(got[3]) != "2" || got[3].Pos.Seq != 2 || dataOf(got[4]) != "3" {
			t.Fatalf("after the rewrite: %q %+v, %q %+v", dataOf(got[3]), got[3].Pos, dataOf(got[4]), got[4].Pos)
		}
	})
}

// A check of heads (every channel of the shard, once per check interval)
// does not hold up announcements: they are delivered while it waits for
// Redis. Here its pipelined read is held in a go-redis hook (the pub/sub
// connection's reads do not pass through pipeline hooks).
func TestRedisAnnouncementsAreDeliveredWhileACheckWaits(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 200 * time.Millisecond})
	rec := follow(t, srv, hub, broker, "busy")

	hold := pipelineHold{gate: newGate(t)}
	broker.Client().AddHook(hold)
	hold.waitHeld(t, "a check's read of heads")
	deliveredWhileHeld(t, hold.gate, pub, rec, "busy", "while checking")
}

// pipelineHold is a go-redis hook that holds every pipeline at its gate.
type pipelineHold struct {
	passThrough
	*gate
}

func (h pipelineHold) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.hold()
		return next(ctx, cmds)
	}
}

// gate holds whoever reaches it until the test opens it (or ends: it is
// opened before the hubs close, as cleanups run last first).
type gate struct {
	entered, opened chan struct{}
	enter, open     sync.Once
}

func newGate(t *testing.T) *gate {
	g := &gate{entered: make(chan struct{}), opened: make(chan struct{})}
	t.Cleanup(g.openUp)
	return g
}

func (g *gate) hold() {
	g.enter.Do(func() { close(g.entered) })
	<-g.opened
}

func (g *gate) openUp() { g.open.Do(func() { close(g.opened) }) }

func (g *gate) isOpen() bool {
	select {
	case <-g.opened:
		return true
	default:
		return false
	}
}

func (g *gate) waitHeld(t *testing.T, what string) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(redisWait):
		t.Fatalf("%s was not held within %v", what, redisWait)
	}
}

// deliveredWhileHeld publishes data to channel through via and expects it
// to be rec's first event while g still holds what it holds.
func deliveredWhileHeld(t *testing.T, g *gate, via *Hub, rec *redisRecorder, channel, data string) {
	t.Helper()
	publishTo(t, via, channel, data)
	got := rec.waitFor(t, 0, 1)
	if dataOf(got[0]) != data {
		t.Fatalf("delivered %q, want %q", dataOf(got[0]), data)
	}
	if g.isOpen() {
		t.Fatal("the gate opened before the event came: the test proves nothing")
	}
}

// The rules of a check that ran while the receive loop went on (syncHead's
// before): a watch that delivered past the head read is left alone (no
// history read: this watcher has no Redis, a read would panic), and a watch
// whose subscription was lost after the read stays behind.
func TestRedisCheckReadBeforeDeliveriesOrALoss(t *testing.T) {
	w := &watcher{}
	at := func(seq uint64) replay.Position { return replay.Position{Epoch: 1, Seq: seq, Time: int64(seq)} }

	ahead := newWatch("ahead", "sse:{ahead}")
	ahead.last, ahead.known = at(5), true
	before := ahead.mark()
	ahead.last = at(7) // announced while the check read the head (6)
	w.syncHead(headOf{wt: ahead, head: at(6), before: before})
	if last, ok := ahead.delivered(); !ok || last != at(7) {
		t.Fatalf("a watch ahead of the head read: %+v, usable %v", last, ok)
	}

	lost := newWatch("lost", "sse:{lost}")
	lost.last, lost.known = at(5), true
	before = lost.mark()
	lost.lostSubscription() // the connection ended after the read
	w.syncHead(headOf{wt: lost, head: at(5), before: before})
	if _, ok := lost.delivered(); ok {
		t.Fatal("a check read before the subscription was lost cleared behind")
	}
	w.syncHead(headOf{wt: lost, head: at(5), before: lost.mark()})
	if _, ok := lost.delivered(); !ok {
		t.Fatal("a check read after the loss left the watch behind")
	}
}

// An event published through this instance reaches its streams without
// waiting for Redis' announcement, when it is the next of a caught-up
// watch. Here the shard's receive loop is held up by another channel's
// subscriber, so no announcement is read meanwhile; the held announcement
// of the event, read later, is not delivered again.
func TestRedisOwnPublishIsDeliveredBeforeItsAnnouncement(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	// no check meanwhile: a watch it holds is left to the announcement
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	own := follow(t, srv, hub, broker, "own")

	blocker := &blockingRecorder{gate: newGate(t)}
	sub := hub.Subscribe(blocker, []string{"other"})
	t.Cleanup(sub.Close)
	t.Cleanup(blocker.openUp) // first: Close waits for the delivery it holds
	srv.WaitShardSubscribers(t, broker.Key("other"), 1)
	waitSynced(t, broker, "other")
	publishTo(t, pub, "other", "holds the receive loop")
	blocker.waitHeld(t, "the receive loop")
	deliveredWhileHeld(t, blocker.gate, hub, own, "own", "published here")

	// published elsewhere, it comes after the held announcement: a
	// duplicate would come between them
	blocker.openUp()
	publishTo(t, pub, "own", "next")
	got := own.waitFor(t, 0, 2)
	if dataOf(got[1]) != "next" {
		t.Fatalf("after the held announcement came %q", dataOf(got[1]))
	}
	assertContiguous(t, got, got[0].Pos.Seq)
}

// blockingRecorder is a subscriber whose first delivery waits at its gate
// (it holds up whichever goroutine delivers).
type blockingRecorder struct {
	*gate
	first sync.Once
}

func (b *blockingRecorder) Deliver(int, *replay.Event) { b.first.Do(b.hold) }

// A publish does not wait for a watch someone else holds (the shard's
// goroutine delivering the announcement that came with the reply, a new
// stream starting): its event is left to the announcement, delivered once.
func TestRedisOwnPublishDoesNotWaitForABusyWatch(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	rec := follow(t, srv, hub, broker, "busy")
	wt := broker.watch.lookup(broker.Key("busy"))
	wt.mu.RLock() // as a starting stream holds it
	release := sync.OnceFunc(wt.mu.RUnlock)
	t.Cleanup(release)
	published := make(chan error, 1)
	go func() {
		_, err := hub.Publish(context.Background(), "busy", Message{Type: "t", Data: []byte("while held")}, testLimits)
		published <- err
	}()
	select {
	case err := <-published:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(redisWait):
		t.Fatalf("the publish waited %v for a watch held elsewhere", redisWait)
	}
	release()
	publishTo(t, hub, "busy", "after")
	got := rec.waitFor(t, 0, 2)
	if dataOf(got[0]) != "while held" || dataOf(got[1]) != "after" {
		t.Fatalf("delivered %q, %q", dataOf(got[0]), dataOf(got[1]))
	}
	assertContiguous(t, got, got[0].Pos.Seq)
}

// Refused keys are asked again in turn: with 40 refused and 16 asked per
// retry, three retries ask every key (the third wraps around), so an ACL
// that grants a few of many is noticed within a round; keys asked and not
// yet answered are not asked twice.
func TestRefusedKeysAreAskedAgainInTurn(t *testing.T) {
	s := &shard{refused: map[string]bool{}}
	for i := range 40 {
		s.refused[fmt.Sprintf("k%02d", i)] = false
	}
	seen := map[string]int{}
	for range 3 {
		keys := s.nextRefusedLocked()
		if len(keys) != refusedRetryBatch {
			t.Fatalf("%d keys asked, want %d", len(keys), refusedRetryBatch)
		}
		for _, k := range keys {
			seen[k]++
		}
	}
	if len(seen) != 40 {
		t.Fatalf("%d of 40 refused keys asked in three retries", len(seen))
	}
	s.refused["k00"] = true // asked, unanswered
	for range 3 {
		for _, k := range s.nextRefusedLocked() {
			if k == "k00" {
				t.Fatal("a key asked and not answered yet was asked again")
			}
		}
	}
}

// A channel's first sync that could not read the newest event (Redis
// failed that one read) is made again at the next check, instead of
// starting the watch at the head without it: a stream that read its
// starting point before this instance's subscription was confirmed learns
// of the events published in between only from that event (syncHead), and
// was otherwise left silent until a next publish, which may never come.
// Here the event was published before the subscription: its first sync
// delivers it once the read succeeds.
func TestRedisFirstSyncWhoseNewestReadFailedIsMadeAgain(t *testing.T) {
	t.Run("functions", func(t *testing.T) { firstSyncAfterAFailedRead(t, false) })
	t.Run("scripts", func(t *testing.T) { firstSyncAfterAFailedRead(t, true) })
}

// firstSyncAfterAFailedRead runs the test above, with scripts where Redis
// forbids functions.
func firstSyncAfterAFailedRead(t *testing.T, forbidFunctions bool) {
	srv := redistest.Start(t)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 300 * time.Millisecond}
	if forbidFunctions {
		opts = withoutFunctions(opts, srv)
	}
	pub, _ := newRedisHub(t, opts)
	sent := publishTo(t, pub, "late", "before the subscription")
	hub, broker := newRedisHub(t, opts)
	failure := &newestReadFailure{}
	broker.Client().AddHook(failure)

	rec := newRedisRecorder()
	t.Cleanup(hub.Subscribe(rec, []string{"late"}).Close)
	got := rec.waitFor(t, 0, 1)
	if failure.failed.Load() == 0 {
		t.Fatal("no read of a newest event failed: the test proves nothing")
	}
	if got[0].Pos != sent || dataOf(got[0]) != "before the subscription" {
		t.Fatalf("delivered %+v %q, want %+v", got[0].Pos, dataOf(got[0]), sent)
	}
}

// A channel whose newest event cannot be read at all (a key of the wrong
// type, an ACL refusing the read) is not left unsynced for good, each new
// stream of it waiting syncWait: after a few checks its watch starts at the
// head without that event, and says so.
func TestRedisFirstSyncWhoseNewestReadFailsForGoodStartsWithoutIt(t *testing.T) {
	srv := redistest.Start(t)
	core, logs := observer.New(zapcore.WarnLevel)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 200 * time.Millisecond}
	pub, _ := newRedisHub(t, opts)
	sent := publishTo(t, pub, "stuck", "unreadable")
	opts.Logger = zap.New(core)
	hub, broker := newRedisHub(t, opts)
	failure := &newestReadFailure{always: true}
	broker.Client().AddHook(failure)

	t.Cleanup(hub.Subscribe(newRedisRecorder(), []string{"stuck"}).Close)
	waitSynced(t, broker, "stuck")
	if n := failure.failed.Load(); n < maxUnreadSyncs {
		t.Fatalf("synced after %d failed reads of the newest event, want %d", n, maxUnreadSyncs)
	}
	if at, ok := broker.watch.startAt(context.Background(), broker.Key("stuck")); !ok || at != sent {
		t.Fatalf("a new stream starts at %+v (%v), want the head %+v", at, ok, sent)
	}
	if logs.FilterMessageSnippet("could not be read").FilterField(zap.String("channel", "stuck")).Len() != 1 {
		t.Fatalf("want one warning naming the channel, got %v", logs.All())
	}
}

// newestReadFailure is a go-redis hook that fails the first pipeline made
// only of the library's reads (a check's read of newest events; a read of
// heads holds HMGETs), as a Redis error would; every such pipeline if
// always is set.
type newestReadFailure struct {
	passThrough
	always bool
	failed atomic.Int32
}

func (f *newestReadFailure) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if name := cmd.Name(); name != "fcall_ro" && name != "evalsha_ro" && name != "eval_ro" {
				return next(ctx, cmds)
			}
		}
		if !f.always && f.failed.Load() > 0 {
			return next(ctx, cmds)
		}
		f.failed.Add(1)
		err := errors.New("ERR the test fails this read")
		for _, cmd := range cmds {
			cmd.SetErr(err)
		}
		return err
	}
}
