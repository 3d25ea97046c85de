package pubsub

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// The committed EVAL scripts are what evalScript derives from redis.lua;
// regenerate them with UPDATE_EVAL_SCRIPTS=1 go test ./pubsub/ -run EvalScriptsAreCurrent.
func TestEvalScriptsAreCurrent(t *testing.T) {
	for file, function := range map[string]string{
		"redis_eval_publish.lua":      FunctionPublish,
		"redis_eval_publish_once.lua": FunctionPublishOnce,
		"redis_eval_read.lua":         FunctionRead,
	} {
		want := evalScript(function)
		if os.Getenv("UPDATE_EVAL_SCRIPTS") != "" {
			if err := os.WriteFile(file, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(file)
		if err != nil || string(got) != want {
			t.Fatalf("%s is not what redis.lua gives; run UPDATE_EVAL_SCRIPTS=1 go test ./pubsub/ -run EvalScriptsAreCurrent", file)
		}
	}
}

// Where functions are forbidden, the broker runs the same code as scripts,
// and a backend can publish with EVAL.
func TestRedisWithoutFunctions(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}}, srv))
	rec := follow(t, srv, hub, broker, "s")
	first := publishTo(t, hub, "s", "via script")
	script, err := os.ReadFile("redis_eval_publish.lua")
	if err != nil {
		t.Fatal(err)
	}
	srv.MustCLI("EVAL", string(script), "1", "sse:{s}", "t", "via EVAL")
	// the publish-once form: the same token twice is one event
	once, err := os.ReadFile("redis_eval_publish_once.lua")
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		srv.MustCLI("EVAL", string(once), "3", "sse:{s}:m", "sse:{s}:s", "sse:{s}:p:tok-1", "tok-1", "30000", "t", "once via EVAL")
	}
	got := rec.waitFor(t, 0, 3)
	assertContiguous(t, got, first.Seq)
	page, err := hub.Read(context.Background(), "s", &first, 10)
	if err != nil || len(page.Events) != 2 || dataOf(page.Events[0]) != "via EVAL" || dataOf(page.Events[1]) != "once via EVAL" {
		t.Fatalf("read: %+v %v", page, err)
	}
}

// wait_replicas publishes on a connection of its own (for WAIT): a Redis
// that forbids functions must send it to the scripts too, from the first
// publish of an instance that has read nothing yet.
func TestRedisWithoutFunctionsWaitReplicas(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}, WaitReplicas: 1, WaitTimeout: 50 * time.Millisecond}, srv))
	for i := range 3 {
		if _, err := hub.Publish(context.Background(), "w", Message{Data: []byte("x")}, testLimits); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	if n := srv.MustCLI("XLEN", "sse:{w}:s"); n != "3" {
		t.Fatalf("the stream holds %s events, want 3", n)
	}
}

// Only a refusal of the function commands themselves sends the broker to
// scripts for good; an out-of-memory refusal (which also says "not
// allowed") or a key the ACL denies does not.
func TestFunctionsForbiddenOnlyForRefusedFunctionCommands(t *testing.T) {
	for msg, want := range map[string]bool{
		"NOPERM this user has no permissions to run the 'fcall' command":                                     true,
		"NOPERM User nofunc has no permissions to run the 'fcall_ro' command":                                true,
		"NOPERM this user has no permissions to run the 'function|load' command":                             true,
		"ERR unknown command 'FCALL', with args beginning with: 'sse_publish_once_v1' '1' 'sse:{a}' ":        true,
		"ERR unknown command 'FUNCTION', with args beginning with: 'LOAD' 'REPLACE' ":                        true,
		"OOM command not allowed when used memory > 'maxmemory'.":                                            false,
		"OOM command not allowed when used memory > 'maxmemory'. script: ff35ca, on @user_script:1.":         false,
		"NOPERM this user has no permissions to access one of the keys used as arguments":                    false,
		"ERR unknown command 'XADD', with args beginning with: ":                                             false,
		"ERR Write commands are not allowed from read-only scripts. script: sse_read_v1, on @user_function.": false,
		"READONLY You can't write against a read only replica.":                                              false,
	} {
		if got := functionsForbidden(redisError(msg)); got != want {
			t.Errorf("functionsForbidden(%q) = %v, want %v", msg, got, want)
		}
	}
	if functionsForbidden(nil) {
		t.Error("functionsForbidden(nil)")
	}
}

type redisError string

func (e redisError) Error() string { return string(e) }
func (redisError) RedisError()     {}

// On a Redis Cluster that forbids functions, a publish to a channel whose
// slot is migrating (its keys still on the source) is answered TRYAGAIN
// and sent again without its token, as the script of sse_publish_v2: the
// broker must have that script (it panicked on a nil script).
func TestRedisWithoutFunctionsPublishesWhileTheSlotMigrates(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	hub, _ := newRedisHub(t, withoutFunctions(RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}, cluster.Nodes...))
	slot := 100
	channel := channelInSlot(t, slot)
	from := cluster.NodeOfSlot(t, slot)
	to := cluster.OtherPrimary(from)
	publishTo(t, hub, channel, "before")
	cluster.MigrateSlotByHand(t, slot, from, to, func(phase string) {
		if phase != "migrating" {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := hub.Publish(ctx, channel, Message{Data: []byte(phase)}, testLimits); err != nil {
			t.Errorf("publish while the slot is %s: %v", phase, err)
		}
	})
	if n := cluster.NodeOfSlot(t, slot).MustCLI("XLEN", "sse:{"+channel+"}:s"); n != "2" {
		t.Fatalf("the channel holds %s events, want 2", n)
	}
}

// A Redis 7 ACL user has no channel unless granted (acl-pubsub-default
// resetchannels): one made with the keys and commands but not the shard
// channels may not announce events. Its publishes are refused with a clear
// error, and nothing is written: SPUBLISH failing at the end of the
// function left the event in the history, unannounced, while the publisher
// was told the publish failed, and each of its retries added another.
func TestRedisUserWithoutChannelsPublishesNothing(t *testing.T) {
	for _, scriptsOnly := range []bool{false, true} {
		rds := redistest.Start(t)
		rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all")
		if scriptsOnly {
			rds.MustCLI("ACL", "SETUSER", "app", "-fcall", "-fcall_ro", "-function")
		}
		hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{rds.Addr()}, Username: "app", Password: "pw"})
		for range 3 { // the publisher retries
			_, err := hub.Publish(context.Background(), "a", Message{Type: "t", Data: []byte("x")}, testLimits)
			if err == nil || !strings.Contains(err.Error(), "may not publish to the shard channel") {
				t.Fatalf("scripts only %v: publish by a user without channels: %v", scriptsOnly, err)
			}
		}
		if n := rds.MustCLI("XLEN", "sse:{a}:s"); n != "0" {
			t.Fatalf("scripts only %v: %s refused publishes are in the history", scriptsOnly, n)
		}
	}
}

// A backend that publishes straight into Redis with limits Redis cannot
// take as a time (max_age_ms or ttl_ms a fraction, as a float computed by
// the backend gives: 1.1 * 3600000 is 3960000.0000000005; NaN; a huge
// value) or a NaN count or byte cap is refused before anything is written.
// PEXPIRE and SET PX refused them at the end of the function, after the
// event was appended: the backend was told the publish failed while every
// instance delivered the event (a check found it), and each retry added
// another; a NaN count or byte cap was accepted and trimmed nothing.
func TestDirectPublishWithLimitsRedisCannotTakeWritesNothing(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("FUNCTION", "LOAD", "REPLACE", RedisFunctions())
	script, err := os.ReadFile("redis_eval_publish.lua")
	if err != nil {
		t.Fatal(err)
	}
	once, err := os.ReadFile("redis_eval_publish_once.lua")
	if err != nil {
		t.Fatal(err)
	}
	const key = "sse:{a}"
	v1 := func(limits ...string) []string {
		return append([]string{"FCALL", FunctionPublish, "1", key, "t", "x"}, limits...)
	}
	onceV2 := func(ttl string) []string {
		return []string{"FCALL", FunctionPublishOnce, "3", key + ":m", key + ":s", key + ":p:tok", "tok", ttl, "t", "x"}
	}
	for _, call := range [][]string{
		v1("1000", "3960000.0000000005"),
		v1("1000", "1e17"),
		v1("1000", "inf"),
		v1("1000", "nan"),
		v1("nan"),
		v1("1000", "86400000", "nan"),
		{"EVAL", string(script), "1", key, "t", "x", "1000", "3960000.0000000005"},
		onceV2("30000.5"),
		onceV2("nan"),
		{"EVAL", string(once), "3", key + ":m", key + ":s", key + ":p:tok", "tok", "30000.5", "t", "x"},
	} {
		out, err := rds.CLI(call...)
		if err != nil || !strings.HasPrefix(out, "ERR sse:") {
			t.Errorf("%q: %v %q, want an sse error", call[len(call)-3:], err, out)
		}
		if n := rds.MustCLI("XLEN", key+":s"); n != "0" {
			t.Fatalf("%q was refused, yet the history has %s events", call[len(call)-3:], n)
		}
	}
	rds.MustCLI(v1("1000", "86400000")...)
	if n := rds.MustCLI("XLEN", key+":s"); n != "1" {
		t.Fatalf("a valid publish: the history has %s events", n)
	}
}

// Where functions are forbidden, the first syncs of new channels read their
// newest events by the script's digest: with its source, each read sent
// Redis the library's 13.6 KB (EVAL_RO). A Redis that does not have the
// script yet is given it once, by one read sent with it (SCRIPT LOAD is not
// in the least-privilege user's grants). Each new channel's newest event is
// still delivered (a stream behind it learns of what it missed).
func TestRedisWithoutFunctionsFirstSyncsReadByDigest(t *testing.T) {
	srv := redistest.Start(t)
	opts := withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute}, srv)
	pub, _ := newRedisHub(t, opts)
	const channels = 20
	newest := make([]replay.Position, channels)
	for c := range channels {
		newest[c] = publishTo(t, pub, fmt.Sprint("digest-", c), "newest")
	}
	srv.MustCLI("SCRIPT", "FLUSH") // as after a restart: the read's script is not there

	hub, _ := newRedisHub(t, opts)
	before := commandCounts(t, srv, "cmdstat_eval_ro", "cmdstat_evalsha_ro")
	recs := make([]*redisRecorder, channels)
	for c := range channels {
		recs[c] = newRedisRecorder()
		t.Cleanup(hub.Subscribe(recs[c], []string{fmt.Sprint("digest-", c)}).Close)
	}
	for c, rec := range recs {
		if got := rec.waitFor(t, 0, 1); got[0].Pos != newest[c] {
			t.Fatalf("channel %d: first sync delivered %+v, want %+v", c, got[0].Pos, newest[c])
		}
	}
	after := commandCounts(t, srv, "cmdstat_eval_ro", "cmdstat_evalsha_ro")
	if bySource, byDigest := after[0]-before[0], after[1]-before[1]; bySource > 1 || byDigest < channels-1 {
		t.Fatalf("first syncs of %d channels: %d reads with the script's source, %d by its digest; want at most 1 and at least %d",
			channels, bySource, byDigest, channels-1)
	}
	if calls := commandCounts(t, srv, "cmdstat_script|load"); calls[0] != 0 {
		t.Fatalf("SCRIPT LOAD ran %d times: a least-privilege user is refused it", calls[0])
	}
}

// withoutFunctions is opts as a user that the servers forbid functions
// (FCALL, FCALL_RO, FUNCTION), created on each: the broker runs the
// library as scripts.
func withoutFunctions(opts RedisOptions, servers ...*redistest.Server) RedisOptions {
	for _, srv := range servers {
		srv.MustCLI("ACL", "SETUSER", "nofunc", "on", ">pw", "~*", "&*", "+@all", "-function", "-fcall", "-fcall_ro")
	}
	opts.Username, opts.Password = "nofunc", "pw"
	return opts
}

// A direct publish whose call is not what the docs give is refused before
// anything is written: each of these was published (to a channel no stream
// can have, or with the defaults in place of limits that are not numbers,
// or as an empty event) and the backend was told it worked.
func TestDirectPublishWithAMistakenCallWritesNothing(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("FUNCTION", "LOAD", "REPLACE", RedisFunctions())
	script, err := os.ReadFile("redis_eval_publish.lua")
	if err != nil {
		t.Fatal(err)
	}
	v1 := func(key string, args ...string) []string {
		return append([]string{"FCALL", FunctionPublish, "1", key}, args...)
	}
	long := strings.Repeat("c", 201)
	for _, call := range [][]string{
		v1("orders", "t", "x"),                          // no braces: no stream's key
		v1("sse:orders", "t", "x"),                      // no braces
		v1("sse:{orders}:m", "t", "x"),                  // a _v2 key given to the _v1 form
		v1("sse:{}", "t", "x"),                          // no channel
		v1("sse:{"+long+"}", "t", "x"),                  // a channel over 200 bytes
		v1("sse:{a\tb}", "t", "x"),                      // a control character
		v1("sse:{orders}", "t", "x", "1k"),              // a count that is not a number
		v1("sse:{orders}", "t", "x", "1000", "24h"),     // nor a max age
		v1("sse:{orders}", "t", "x", "1000", "1", "4M"), // nor a byte cap
		v1("sse:{orders}", "t"),                         // no data
		v1("sse:{orders}"),                              // neither type nor data
		v1("sse:{orders}", "t", "x", "1000", "86400000", "4194304", "extra"),
		{"FCALL", FunctionPublishV2, "2", "sse:{orders}:m:m", "sse:{orders}:m:s", "t", "x"},
		{"FCALL", FunctionPublishOnce, "3", "sse:{orders}:m", "sse:{orders}:s", "sse:{orders}:p:tok", "tok", "60000", "t"},
		{"EVAL", string(script), "1", "orders", "t", "x"},
		{"EVAL", string(script), "1", "sse:{orders}", "t", "x", "abc"},
	} {
		out, err := rds.CLI(call...)
		if err != nil || !strings.HasPrefix(out, "ERR sse:") {
			t.Errorf("%q: %v %q, want an sse error", call[min(len(call), 4)-1:], err, out)
		}
		if n := rds.MustCLI("DBSIZE"); n != "0" {
			t.Fatalf("%q was refused, yet Redis holds %s keys: %s", call[min(len(call), 4)-1:], n, rds.MustCLI("KEYS", "*"))
		}
	}
	// the documented forms still publish, with or without limits, also
	// empty ones and the instances' own channel of throttles
	for _, call := range [][]string{
		v1("sse:{orders}", "t", "x"),
		v1("sse:{orders}", "", ""),
		v1("sse:{orders}", "t", "x", "1000", "86400000", "4194304"),
		v1("sse:{orders}", "t", "x", "", "", "4194304"),
		v1("app:{tenant:orders}", "t", "x"),
		v1("sse:{sse,throttles}", "throttle", "{}"),
		{"FCALL", FunctionPublishOnce, "3", "sse:{orders}:m", "sse:{orders}:s", "sse:{orders}:p:tok", "tok", "60000", "t", "x"},
	} {
		if out := rds.MustCLI(call...); strings.Contains(out, "ERR") {
			t.Fatalf("%q: %s", call, out)
		}
	}
}
