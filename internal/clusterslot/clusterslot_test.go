package clusterslot

import (
	"strings"
	"testing"
)

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

// FuzzOf checks Of against the Cluster specification's keyHashSlot, as
// its C reads (index by index), with a table-driven CRC16: a key with a
// non-empty tag has its tag's slot, whatever is around the tag.
func FuzzOf(f *testing.F) {
	f.Add("123456789", "")
	f.Add("foo{}{bar}", "bar")
	f.Add("{{", "}")
	f.Add("sse:{a}:m", "a\xff")
	f.Fuzz(func(t *testing.T, key, tag string) {
		if got, want := Of(key), specSlot(key); got != want || got >= 16384 {
			t.Fatalf("Of(%q) = %d, the specification's keyHashSlot %d", key, got, want)
		}
		if tag == "" || strings.ContainsRune(tag, '}') || strings.ContainsRune(key, '{') {
			return
		}
		if tagged := key + "{" + tag + "}" + key; Of(tagged) != Of(tag) {
			t.Fatalf("Of(%q) = %d, its tag %q has %d", tagged, Of(tagged), tag, Of(tag))
		}
	})
}

// specSlot is keyHashSlot of the Redis Cluster specification.
func specSlot(key string) uint16 {
	s := 0
	for s = 0; s < len(key); s++ {
		if key[s] == '{' {
			break
		}
	}
	if s == len(key) {
		return crc16(key) & 0x3FFF
	}
	e := 0
	for e = s + 1; e < len(key); e++ {
		if key[e] == '}' {
			break
		}
	}
	if e == len(key) || e == s+1 {
		return crc16(key) & 0x3FFF
	}
	return crc16(key[s+1:e]) & 0x3FFF
}

// crc16tab is the CRC16-CCITT (XMODEM) table, polynomial 0x1021.
var crc16tab = func() (tab [256]uint16) {
	for i := range tab {
		c := uint16(i) << 8
		for range 8 {
			c = c<<1 ^ 0x1021*(c>>15)
		}
		tab[i] = c
	}
	return tab
}()

func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc = crc<<8 ^ crc16tab[byte(crc>>8)^s[i]]
	}
	return crc
}
