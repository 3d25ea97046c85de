package caddysse

import (
	"bytes"
	"encoding/json"
	"testing"
)

// decodeJSONPublish accepts only what encoding/json reads the same way: a
// body it accepts is valid JSON, decodes with encoding/json to the same
// three fields, and has no other field.
func FuzzDecodeJSONPublishAgreesWithEncodingJSON(f *testing.F) {
	for _, seed := range []string{
		`{"channel":"a","data":"x"}`,
		`{"channel":["a","b"],"event":"t","data":{"k":[1,2,null]}}`,
		`{"channel":"a","channel":"b"}`,
		`{"channel":"a","Channel":"b"}`,
		`{"channel":"a"}}`,
		`{"channel":"a"} ]`,
		` {"data":null} `,
		`["a"]`,
		`{"channel":"a","data":"x"`,
		`{}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		in, err := decodeJSONPublish(body)
		if err != nil {
			return
		}
		if !json.Valid(body) {
			t.Fatalf("accepted invalid JSON %q", body)
		}
		var std jsonPublish
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&std); err != nil {
			t.Fatalf("accepted %q, which encoding/json refuses: %v", body, err)
		}
		for _, pair := range [][2]json.RawMessage{{in.Channel, std.Channel}, {in.Event, std.Event}, {in.Data, std.Data}} {
			if !bytes.Equal(compactJSON(pair[0]), compactJSON(pair[1])) {
				t.Fatalf("%q: read %q, encoding/json %q", body, pair[0], pair[1])
			}
		}
	})
}

func compactJSON(raw json.RawMessage) []byte {
	var out bytes.Buffer
	if len(raw) == 0 || json.Compact(&out, raw) != nil {
		return raw
	}
	return out.Bytes()
}
