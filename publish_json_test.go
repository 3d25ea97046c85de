package caddysse

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
	"unicode/utf8"
)

// The quick reading of a publish body accepts only what the token-by-token
// reading accepts, and reads the same three values, byte for byte.
func FuzzSplitPublishObjectAgreesWithTokens(f *testing.F) {
	for _, seed := range []string{
		`{"channel":"a","data":"x"}`,
		" {\n\t\"channel\" : [ \"a\" , \"b\" ] ,\r\n \"event\":\"t\", \"data\" : {\"k\": [1, 2.5e-3, null, true, {\"}\": \"]\"}]} } ",
		`{"channel":"a","data":-0.5E+2}`,
		`{"data":"a\"b\\","channel":"c"}`,
		`{"channel":"a","channel":"b"}`,
		`{"channel":"a","Channel":"b"}`,
		`{"ch\u0061nnel":"a"}`,
		`{"channel":"a"}}`,
		`{"channel":"a"} ]`,
		`{"data":null,"event":null}`,
		`["a"]`,
		`"channel"`,
		`{"channel":"a","data":"x"`,
		`{}`,
		``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		quick, ok := splitPublishObject(body)
		if !ok {
			return
		}
		slow, err := decodeJSONPublishTokens(body)
		if err != nil {
			t.Fatalf("read %q, which the tokens refuse: %v", body, err)
		}
		for _, pair := range [][2]json.RawMessage{{quick.Channel, slow.Channel}, {quick.Event, slow.Event}, {quick.Data, slow.Data}} {
			if !bytes.Equal(pair[0], pair[1]) || (pair[0] == nil) != (pair[1] == nil) {
				t.Fatalf("%q: read %q, the tokens %q", body, pair[0], pair[1])
			}
		}
	})
}

// The quick readings of a field's valid JSON value (the body is valid
// UTF-8) agree with encoding/json wherever they answer.
func FuzzPlainJSONReadersAgreeWithEncodingJSON(f *testing.F) {
	for _, seed := range []string{
		`"a"`, `""`, `"a\"b"`, `"é\u00e9"`, `["a", "b" ,"c"]`, `[]`, `[ ]`, `["a",1]`, `[["a"]]`, `["a",null]`,
		`{"k" : [1, 2.5e-3, null, true, {"}": "]"}]}`, " [ \"a b\" ,\t\"c\\n\" ] ", `-1.5e3`, `null`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || !utf8.Valid(raw) {
			return
		}
		raw = bytes.TrimSpace(raw) // as a field's value is
		var compact bytes.Buffer
		if err := json.Compact(&compact, raw); err != nil {
			t.Fatal(err)
		}
		if got := appendCompactJSON(nil, raw); !bytes.Equal(got, compact.Bytes()) {
			t.Fatalf("%q compacts to %q, encoding/json %q", raw, got, compact.Bytes())
		}
		if plain, ok := plainJSONString(raw); ok {
			var s string
			if err := json.Unmarshal(raw, &s); err != nil || s != string(plain) {
				t.Fatalf("%q read as %q; encoding/json %q, %v", raw, plain, s, err)
			}
		}
		if list, ok := plainJSONStrings(raw); ok {
			var many []string
			if err := json.Unmarshal(raw, &many); err != nil || !slices.Equal(list, many) || many == nil {
				t.Fatalf("%q read as %q; encoding/json %q, %v", raw, list, many, err)
			}
		}
	})
}
