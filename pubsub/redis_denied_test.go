package pubsub

import "testing"

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
