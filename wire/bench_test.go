package wire

import (
	"strings"
	"testing"
)

func BenchmarkAppendEvent(b *testing.B) {
	for _, size := range []int{64, 1024, 16 << 10} {
		data := []byte(strings.Repeat(strings.Repeat("x", 79)+"\n", size/80+1)[:size])
		b.Run(byteSize(size), func(b *testing.B) {
			buf := make([]byte, 0, 2*size)
			b.ReportAllocs()
			b.SetBytes(int64(size))
			for b.Loop() {
				buf = AppendEvent(buf[:0], "invoice", data)
			}
		})
	}
}

func byteSize(n int) string {
	switch {
	case n >= 1<<10:
		return itoa(n>>10) + "KiB"
	default:
		return itoa(n) + "B"
	}
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}
