package clusterslot

import "testing"

func TestOf(t *testing.T) {
	for key, want := range map[string]uint16{
		"123456789":            12739, // the Cluster specification's CRC16 check value 0x31C3
		"{user1000}.following": Of("user1000"),
		"{user1000}.followers": Of("user1000"),
		"foo{}{bar}":           Of("foo{}{bar}"), // an empty tag: the whole key
		"foo{{bar}}zap":        Of("{bar"),
		"foo{bar}{zap}":        Of("bar"),
		"sse:{a}":              Of("a"),
		"sse:{a}:meta":         Of("a"),
	} {
		if got := Of(key); got != want {
			t.Errorf("Of(%q) = %d, want %d", key, got, want)
		}
	}
}
