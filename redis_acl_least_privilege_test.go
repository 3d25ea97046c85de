package caddysse

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
)

// The least a Redis ACL user needs (README, "A least-privilege Redis
// user"): the prefix's keys and shard channels, and these commands. Redis
// checks the commands that a function or script runs against the caller's
// ACL too, so the library's (redis.lua) and the scripts' are here.
var (
	// aclLibrary: publishing and reading (the function library), loading
	// it where it is missing.
	aclLibrary = []string{"+fcall", "+fcall_ro", "+function|load"}
	// aclScripted: what the library's code runs where functions are
	// refused (the broker falls back to EVALSHA, EVAL).
	aclScripted = []string{"+evalsha_ro", "+eval_ro"}
	aclCommands = []string{
		// scripts: leases, throttles and idempotency keys always run them
		"+evalsha", "+eval",
		// the pub/sub connections (and their PING when quiet), the checks
		// of heads
		"+ssubscribe", "+sunsubscribe", "+ping", "+hmget",
		// idempotency keys (SET NX, GET), throttles (PTTL), leases' removal
		// (ZREM), Redis' clock (TIME: leases, throttles and a degraded
		// stream's catch-up are timed by it, not the instance's)
		"+set", "+get", "+pttl", "+zrem", "+time",
		// run only inside the library (redis.lua) and the scripts
		"+zadd", "+zcount", "+pexpire", "+xadd", "+xlen", "+xrange", "+xrevrange", "+xtrim", "+hset", "+del",
		"+spublish", "+exists", "+zremrangebyscore", "+zcard", "+zscore",
	}
	// aclSituational: for db other than 0, for wait_replicas
	aclSituational = []string{"+select", "+wait"}
	// aclCluster: a cluster's slots; go-redis' routing reads COMMAND (and
	// asks again before every command while it is refused); ASKING
	// follows a slot being migrated; CLUSTER NODES finds the primaries that
	// serve no slot yet, to load the library there (loadOnSlotlessPrimaries)
	aclCluster = []string{"+cluster|slots", "+cluster|nodes", "+command", "+asking"}
	// aclSentinel is the Sentinels' own user (sentinel_username): the
	// master's address, the other Sentinels, and the subscription to
	// failovers that go-redis pings when quiet
	aclSentinel = []string{"+sentinel|get-master-addr-by-name", "+sentinel|sentinels", "+subscribe", "+ping",
		"&+switch-master", "&+replica-reconf-done"}
	// aclUnreached are commands of the list that the test's flows do not
	// make Redis run: ASKING needs a slot migrating.
	aclUnreached = []string{"+asking"}
)

// setACLUser makes the Redis user app (password pw) with the prefix's keys
// and shard channels, no command but grants, and no other channel.
func setACLUser(t *testing.T, rds *redistest.Server, grants ...string) {
	t.Helper()
	args := append([]string{"ACL", "SETUSER", "app", "reset", "on", ">pw", "resetchannels", "~sse:*", "&sse:*", "-@all"}, grants...)
	rds.MustCLI(args...)
}

// aclLeastSite has two routes on Redis database 1 as user app, with
// every Redis feature of the module on: caps (leases), throttles, a short
// history (trimmed), and wait_replicas on the second.
func aclLeastSite(rds *redistest.Server) string {
	route := func(path, settings string) string {
		return `
	sse ` + path + ` {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 1
		max_connections 2
		lease_ttl 300ms
		throttle 30s
		history 3
		redis {
			url ` + rds.URL() + `/1
			username app
			password pw
			check_interval 300ms
			` + settings + `
		}
		publish {
			secret ` + testSecret + `
		}
	}`
	}
	return `
:{PORT} {` + route("/events", "") + route("/waited", "wait_replicas 1 20ms") + `
}
`
}

// commandCalls is the calls of each command run, by Redis' INFO
// commandstats (the commands of functions and scripts are counted too).
func commandCalls(t *testing.T, rds *redistest.Server) map[string]int {
	t.Helper()
	calls := map[string]int{}
	for _, line := range strings.Split(rds.MustCLI("INFO", "commandstats"), "\n") {
		name, rest, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "cmdstat_"), ":calls=")
		if !ok {
			continue
		}
		n, _ := strconv.Atoi(strings.Split(rest, ",")[0])
		calls[name] = n
	}
	return calls
}

// aclLogObjects is what Redis' ACL LOG says each refusal was of.
func aclLogObjects(t *testing.T, rds *redistest.Server) []string {
	t.Helper()
	lines := strings.Split(rds.MustCLI("ACL", "LOG"), "\n")
	var objects []string
	for i, line := range lines {
		if strings.TrimSpace(line) == "object" && i+1 < len(lines) {
			objects = append(objects, strings.TrimSpace(lines[i+1]))
		}
	}
	return objects
}

// runACLFlows runs the module's main flows against rds: a publish and its
// live delivery, a principal's cap, an Idempotency-Key, a publish that
// waits for replicas, a reconnect with Last-Event-ID, a full instance, the
// admin stats, a throttle made by another instance, and the quiet spells
// of pings, checks and lease renewals. Every one must work.
func runACLFlows(t *testing.T, rds *redistest.Server) {
	t.Helper()
	admin := "127.0.0.1:" + strconv.Itoa(freePort(t))
	srv := startCaddy(t, aclLeastSite(rds), "admin "+admin)
	t.Cleanup(func() { _ = caddy.Load([]byte(`{"admin":{"disabled":true}}`), true) })

	live := srv.subscribe("/events?channels=a&user=u1", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "one"})
	first := live.next()
	if first.Data != "one" {
		t.Fatalf("live: %+v, want the event published", first)
	}
	if got := srv.getRefusal("/events?channels=a&user=u1"); got.code != "too_many_connections" {
		t.Fatalf("a second stream of a principal capped at one: %+v, want too_many_connections", got)
	}

	key := header("Idempotency-Key", "k-1")
	body := mustJSON(t, map[string]any{"channel": "a", "data": "two"})
	s1, r1 := srv.post("/events", "application/json", body, key)
	s2, r2 := srv.post("/events", "application/json", body, key)
	if s1 != 200 || s2 != 200 || string(r1) != string(r2) {
		t.Fatalf("a keyed publish and its retry: %d %s, %d %s", s1, r1, s2, r2)
	}
	srv.publish("/waited", map[string]any{"channel": "a", "data": "three"})
	srv.publish("/events", map[string]any{"channel": "a", "data": "four"}) // trims the history
	if got := live.nextData(3); got[0] != "two" || got[1] != "three" || got[2] != "four" {
		t.Fatalf("live: %q", got)
	}

	// the pub/sub connection is pinged once quiet for a check interval
	eventually(t, "a quiet pub/sub connection to be pinged", func() bool { return commandCalls(t, rds)["ping"] > 0 })

	// the client reconnects once its stream ended: its lease was removed,
	// the channel unsubscribed, and watched anew it is synced first
	live.close()
	rds.WaitShardSubscribers(t, "sse:{a}", 0)
	eventually(t, "the closed stream's lease to be removed", func() bool {
		return rds.MustCLI("-n", "1", "ZCARD", "sse:lease:{u1}") == "0"
	})
	again := srv.subscribe("/events?channels=a&user=u1", header("Last-Event-ID", first.ID))
	if got := again.nextData(3); got[0] != "two" || got[2] != "four" {
		t.Fatalf("replay after Last-Event-ID: %q", got)
	}

	// a full instance counts the principal's streams across instances
	srv.subscribe("/events?channels=b&user=u2", nil).comment("ok")
	if got := srv.getRefusal("/events?channels=b&user=u3"); got.code != "server_full" {
		t.Fatalf("a stream of a full instance: %+v", got)
	}
	if status, stats := getStats(t, "http://"+admin+"/sse/stats"); status != 200 || len(stats.Hubs) == 0 || stats.Hubs[0].ClusterError != "" {
		t.Fatalf("stats: %d %+v", status, stats)
	}

	throttleAsAnotherInstance(t, rds, "u4")
	eventually(t, "the throttled client to be refused", func() bool {
		return srv.getRefusal("/events?channels=c&user=u4").code == "throttled"
	})

	// Quiet spells (a check_interval and more): the pings, head checks and
	// lease renewals that only time brings, for ACL LOG to show any refused.
	time.Sleep(400 * time.Millisecond)
}

// throttleAsAnotherInstance throttles principal's client (from 127.0.0.1)
// through a hub of its own as the user app: another instance.
func throttleAsAnotherInstance(t *testing.T, rds *redistest.Server, principal string) {
	t.Helper()
	hub, err := pubsub.NewRedisHub(pubsub.RedisOptions{Addrs: []string{rds.Addr()}, Username: "app", Password: "pw", DB: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer hub.Close()
	who := client{principal: principal, ip: "127.0.0.1"}
	if err := hub.Throttles().Throttle(context.Background(), (&Handler{}).throttleKey(who), 30*time.Second); err != nil {
		t.Fatal(err)
	}
}

// flowsAsUser runs the flows on a Redis of its own whose user app has
// grants, counting only the flows' commands.
func flowsAsUser(t *testing.T, grants []string) *redistest.Server {
	t.Helper()
	rds := redistest.Start(t)
	setACLUser(t, rds, grants...)
	rds.MustCLI("CONFIG", "RESETSTAT")
	runACLFlows(t, rds)
	return rds
}

// A Redis ACL user with the documented commands and nothing else: every
// flow of the module works, and Redis refused nothing (ACL LOG: some
// refusals fail nothing the flows see, as an unsubscribe's, a lease's
// removal, the full instance's count or WAIT's).
func TestRedisLeastPrivilegeUser(t *testing.T) {
	grants := slices.Concat(aclLibrary, aclCommands, aclSituational)
	rds := flowsAsUser(t, grants)
	if refused := aclLogObjects(t, rds); len(refused) > 0 {
		t.Fatalf("Redis refused the user %q (ACL LOG)", refused)
	}
	expectRun(t, rds, grants)
}

// Where functions are refused (no FCALL, FCALL_RO, FUNCTION), the broker
// runs the library's code as scripts: EVALSHA_RO and EVAL_RO take their
// place. Redis refuses nothing but the function calls that make the
// broker switch.
func TestRedisLeastPrivilegeUserWithoutFunctions(t *testing.T) {
	grants := slices.Concat(aclScripted, aclCommands, aclSituational)
	rds := flowsAsUser(t, grants)
	refused := aclLogObjects(t, rds)
	if len(refused) == 0 {
		t.Fatal("Redis refused no function call: the test proves nothing")
	}
	for _, object := range refused {
		if object != "fcall" && object != "fcall_ro" {
			t.Errorf("Redis refused the user %s (ACL LOG), besides the function calls", object)
		}
	}
	expectRun(t, rds, grants)
}

// expectRun checks that Redis ran each command granted, but those the
// flows cannot reach (aclUnreached): the list is no broader than the module
// needs.
func expectRun(t *testing.T, rds *redistest.Server, grants []string) {
	t.Helper()
	calls := commandCalls(t, rds)
	for _, grant := range grants {
		if name := strings.TrimPrefix(grant, "+"); calls[name] == 0 && !slices.Contains(aclUnreached, grant) {
			t.Errorf("%s was granted and never run", grant)
		}
	}
}

// A Redis Cluster: each node has the user, with the cluster's commands
// besides; streams and publishes of channels on every primary, and their
// caps, work, and no node refused anything.
func TestRedisLeastPrivilegeUserOnACluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	grants := slices.Concat(aclLibrary, aclCommands, aclCluster)
	for _, n := range cluster.Nodes {
		setACLUser(t, n, grants...)
		n.MustCLI("CONFIG", "RESETSTAT")
	}
	srv := startCaddy(t, redisBlockSite("addresses "+strings.Join(cluster.Addrs(), " ")+
		"\n\t\t\tusername app\n\t\t\tpassword pw\n\t\t\tcheck_interval 300ms",
		"principal {query.user}", "max_connections_per_principal 1"))
	channels := []string{"a", "b", "c", "d"} // on three primaries
	streams := make([]*sseClient, len(channels))
	for i, ch := range channels {
		streams[i] = srv.subscribe("/events?user="+ch+"&channels="+ch, nil)
		cluster.NodeOfSlot(t, redistest.SlotOf(ch)).WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	}
	for i, ch := range channels {
		srv.publish("/events", map[string]any{"channel": ch, "data": "live-" + ch})
		if ev := streams[i].next(); ev.Data != "live-"+ch {
			t.Fatalf("channel %s: %+v, want its live event", ch, ev)
		}
	}
	calls := map[string]int{}
	for _, n := range cluster.Nodes {
		if refused := aclLogObjects(t, n); len(refused) > 0 {
			t.Errorf("node %s refused the user %q (ACL LOG)", n.Addr(), refused)
		}
		for name, c := range commandCalls(t, n) {
			calls[name] += c
		}
	}
	for _, grant := range aclCluster {
		if name := strings.TrimPrefix(grant, "+"); calls[name] == 0 && !slices.Contains(aclUnreached, grant) {
			t.Errorf("%s was granted and never run", grant)
		}
	}
}

// Sentinel: the data nodes have the user (ACLs are not replicated: the
// replica, a primary after a failover, needs it too), the Sentinel a user
// of its own (sentinel_username) with aclSentinel. The master is found,
// events flow, and nothing is refused, also once go-redis has pinged its
// quiet subscription to the Sentinel's failovers (every 3 s).
func TestRedisLeastPrivilegeUsersWithSentinel(t *testing.T) {
	s := redistest.StartSentinel(t)
	for _, n := range []*redistest.Server{s.Primary, s.Replica} {
		setACLUser(t, n, slices.Concat(aclLibrary, aclCommands)...)
	}
	s.Sentinel.MustCLI(append([]string{"ACL", "SETUSER", "watcher", "reset", "on", ">spw", "resetchannels", "-@all"}, aclSentinel...)...)
	srv := startCaddy(t, redisBlockSite("addresses "+s.Sentinel.Addr()+"\n\t\t\tsentinel "+s.Master+
		"\n\t\t\tsentinel_username watcher\n\t\t\tsentinel_password spw"+
		"\n\t\t\tusername app\n\t\t\tpassword pw\n\t\t\tcheck_interval 300ms"))
	c := srv.subscribe("/events?channels=p", nil)
	s.Primary.WaitShardSubscribers(t, "sse:{p}", 1)
	srv.publish("/events", map[string]any{"channel": "p", "data": "live"})
	if ev := c.next(); ev.Data != "live" {
		t.Fatalf("%+v, want the live event", ev)
	}
	eventually(t, "go-redis to ping its quiet Sentinel subscription (every 3 s)", func() bool {
		for _, line := range strings.Split(s.Sentinel.MustCLI("CLIENT", "LIST"), "\n") {
			// a refused command is a client's last command too
			if strings.Contains(line, " user=watcher ") && strings.Contains(line, " cmd=ping ") {
				return true
			}
		}
		return false
	})
	for _, n := range []*redistest.Server{s.Primary, s.Replica, s.Sentinel} {
		if refused := aclLogObjects(t, n); len(refused) > 0 {
			t.Errorf("%s refused its user %q (ACL LOG)", n.Addr(), refused)
		}
	}
}

// README gives the least-privilege user as one ACL SETUSER line: it grants
// what the test does.
func TestREADMEGivesTheLeastPrivilegeUser(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var line string
	for l := range strings.SplitSeq(string(readme), "\n") {
		if strings.Contains(l, "ACL SETUSER") && strings.Contains(l, "-@all") {
			line = l
		}
	}
	if line == "" {
		t.Fatal("README has no ACL SETUSER line with -@all")
	}
	granted := strings.Fields(line)
	for _, grant := range slices.Concat([]string{"resetchannels", "~sse:*", "&sse:*"}, aclLibrary, aclCommands) {
		if !slices.Contains(granted, grant) {
			t.Errorf("README's ACL SETUSER line lacks %s", grant)
		}
	}
	for _, grant := range granted {
		if strings.HasPrefix(grant, "+") && !slices.Contains(slices.Concat(aclLibrary, aclCommands), grant) {
			t.Errorf("README's ACL SETUSER line grants %s, which the test does not", grant)
		}
	}
}
