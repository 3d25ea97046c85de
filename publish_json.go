package caddysse

import (
	"bytes"
	"encoding/json"
	"slices"
)

// What a publish body usually is — one JSON object of plain names and
// strings without escapes — is read here without encoding/json's tokenizer,
// which allocates an error for every value it reads from a stream (its
// scanner reports the byte after a value as a syntax error, which the
// decoder then ignores) and was most of a publish's garbage
// (docs/PERFORMANCE.md). Each function answers only what it is sure of
// and says when it is not: the caller then reads the body as before, so
// what is accepted, refused and said in a refusal does not change.

// splitPublishObject reads the body's three fields, raw. ok is false
// unless the body is valid JSON (json.Valid, which allocates nothing for
// it) and an object whose names are channel, event and data, each at most
// once and without escapes.
func splitPublishObject(body []byte) (in jsonPublish, ok bool) {
	if !json.Valid(body) {
		return in, false
	}
	i := skipJSONSpace(body, 0)
	if body[i] != '{' {
		return in, false
	}
	i++
	for {
		i = skipJSONSpace(body, i)
		switch body[i] {
		case '}':
			return in, true // json.Valid: only space follows
		case ',':
			i = skipJSONSpace(body, i+1)
		}
		end, escaped := jsonStringEnd(body, i)
		field := in.field(body[i+1 : end-1])
		if escaped || field == nil || *field != nil {
			return in, false // an escape, an unknown or a repeated name
		}
		i = skipJSONSpace(body, end) + 1 // past the colon
		i = skipJSONSpace(body, i)
		end = jsonValueEnd(body, i)
		*field = body[i:end:end]
		i = end
	}
}

// field is the field named name, or nil.
func (in *jsonPublish) field(name []byte) *json.RawMessage {
	switch string(name) {
	case "channel":
		return &in.Channel
	case "event":
		return &in.Event
	case "data":
		return &in.Data
	}
	return nil
}

func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// jsonStringEnd returns the index after the valid JSON string that starts
// at b[i], and whether it holds an escape.
func jsonStringEnd(b []byte, i int) (end int, escaped bool) {
	for j := i + 1; ; j++ {
		switch b[j] {
		case '\\':
			escaped = true
			j++ // the escaped byte: a quote here does not end the string
		case '"':
			return j + 1, escaped
		}
	}
}

// jsonValueEnd returns the index after the valid JSON value that starts at
// b[i].
func jsonValueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		end, _ := jsonStringEnd(b, i)
		return end
	case '{', '[':
		depth := 0
		for j := i; ; j++ {
			switch b[j] {
			case '"':
				j, _ = jsonStringEnd(b, j)
				j--
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
	}
	j := i // a number, true, false or null: up to what follows it
	for j < len(b) && !endsJSONLiteral(b[j]) {
		j++
	}
	return j
}

func endsJSONLiteral(c byte) bool {
	switch c {
	case ',', '}', ']', ' ', '\t', '\n', '\r':
		return true
	}
	return false
}

// plainJSONString returns the text of a valid JSON string without
// escapes, which is its bytes between the quotes (the body is valid UTF-8).
func plainJSONString(raw []byte) ([]byte, bool) {
	if len(raw) < 2 || raw[0] != '"' || bytes.IndexByte(raw, '\\') >= 0 {
		return nil, false
	}
	return raw[1 : len(raw)-1], true
}

// plainJSONStrings reads a valid JSON array of strings without escapes.
func plainJSONStrings(raw []byte) ([]string, bool) {
	if len(raw) < 2 || raw[0] != '[' || bytes.IndexByte(raw, '\\') >= 0 {
		return nil, false
	}
	out := []string{}
	for i := skipJSONSpace(raw, 1); raw[i] != ']'; i = skipJSONSpace(raw, i) {
		if raw[i] == ',' {
			i = skipJSONSpace(raw, i+1)
		}
		if raw[i] != '"' {
			return nil, false
		}
		end, _ := jsonStringEnd(raw, i)
		out = append(out, string(raw[i+1:end-1]))
		i = end
	}
	return out, true
}

// appendCompactJSON appends the valid JSON value raw without its
// insignificant space, as json.Compact does, with one allocation at most.
func appendCompactJSON(dst, raw []byte) []byte {
	dst = slices.Grow(dst, len(raw))
	for i := 0; i < len(raw); {
		switch c := raw[i]; c {
		case ' ', '\t', '\n', '\r':
			i++
		case '"':
			end, _ := jsonStringEnd(raw, i)
			dst = append(dst, raw[i:end]...)
			i = end
		default:
			dst = append(dst, c)
			i++
		}
	}
	return dst
}
