package pubsub

import (
	"bytes"
	"testing"

	"github.com/caddy-sse/caddy-sse/wire"
)

// frameData returns the data of any one-line event as the encoder wrote it,
// and never panics on other bytes.
func FuzzFrameData(f *testing.F) {
	f.Add("throttle", []byte(`{"k":"user|1.2.3.4","ms":60000}`), []byte("data: x\n"))
	f.Add("", []byte(""), []byte("event: t\ndata: "))
	f.Add("t", []byte("data: inside"), []byte("\ndata: \n"))
	f.Fuzz(func(t *testing.T, typ string, data, other []byte) {
		frameData(other) // must not panic
		if !wire.ValidEventType(typ) || bytes.ContainsAny(data, "\r\n") {
			return
		}
		got, ok := frameData(wire.AppendEvent(nil, typ, data))
		if !ok || !bytes.Equal(got, data) {
			t.Fatalf("frameData of event %q %q: %q, %v", typ, data, got, ok)
		}
	})
}
