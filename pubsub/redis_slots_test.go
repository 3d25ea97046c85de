package pubsub

import (
	"strconv"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

func TestKeySlot(t *testing.T) {
	for key, want := range map[string]uint16{
		"123456789":            12739, // the Cluster specification's CRC16 check value 0x31C3
		"{user1000}.following": keySlot("user1000"),
		"{user1000}.followers": keySlot("user1000"),
		"foo{}{bar}":           keySlot("foo{}{bar}"), // an empty tag: the whole key
		"foo{{bar}}zap":        keySlot("{bar"),
		"foo{bar}{zap}":        keySlot("bar"),
		"sse:{a}":              uint16(redistest.SlotOf("a")),
		"sse:{a}:meta":         uint16(redistest.SlotOf("a")),
	} {
		if got := keySlot(key); got != want {
			t.Errorf("keySlot(%q) = %d, want %d", key, got, want)
		}
	}
	for i := range 1000 {
		ch := "ch" + strconv.Itoa(i)
		if got, want := keySlot("p:{"+ch+"}"), uint16(redistest.SlotOf(ch)); got != want {
			t.Fatalf("keySlot of %s's key = %d, want %d", ch, got, want)
		}
	}
}
