package pubsub

import (
	"context"
	"errors"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// Only a refusal of PING itself answers a pub/sub connection's PING; a
// refused subscription (of the command, or of a channel) does not.
func TestIsPingRefusedOnlyForARefusedPing(t *testing.T) {
	for msg, want := range map[string]bool{
		"NOPERM this user has no permissions to run the 'ping' command":                       true,
		"NOPERM User app has no permissions to run the 'ping' command":                        true,
		"NOPERM this user has no permissions to run the 'ssubscribe' command":                 false,
		"NOPERM this user has no permissions to access one of the channels used as arguments": false,
		"ERR unknown command 'PING'":                                                          false,
	} {
		if got := isPingRefused(redisError(msg)); got != want {
			t.Errorf("isPingRefused(%q) = %v, want %v", msg, got, want)
		}
	}
	if isPingRefused(nil) {
		t.Error("isPingRefused(nil)")
	}
}

// While Redis is marked down, a publish asks a probe (a PING) whether Redis
// answers. A user without +ping gets NOPERM: an answer, though not a PONG.
// It was taken for none, so the publish failed (503) while Redis answered.
func TestRedisProbeTakesARefusedPingForAnAnswer(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-ping")
	b, err := NewRedis(RedisOptions{Addrs: []string{srv.Addr()}, Username: "app", Password: "pw"}, func(string, *replay.Event) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	b.setUp(false, errors.New("a test marks it down"))
	if !b.reachable(context.Background(), b.Key("a")) {
		t.Fatal("a probe answered NOPERM was taken for no answer")
	}
}
