package caddysse

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
	"unicode/utf8"
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

// FuzzReadPublishRoundTrip: a publish encoded the ways a client may send
// it (JSON with the channel as a string or a list, a URL-encoded form, a
// multipart form with the data as a field or as a file) reads back as
// exactly the request that was sent, with duplicate channels dropped, if
// and only if the request is valid; and how it was encoded never changes
// the answer. channels are split at NUL.
func FuzzReadPublishRoundTrip(f *testing.F) {
	f.Add("news", "", []byte("hello"))
	f.Add("a\x00b\x00a", "update", []byte("line 1\r\nline 2\rline 3\n"))
	f.Add("user:1", "t", []byte(`{"k":[1,"\ud800"]}`))
	f.Add("a", "sse_truncated", []byte(""))
	f.Add("a ", "x\ny", []byte("\xff"))
	f.Add("a{b}", "ü", []byte("\u2028<&>\x00"))
	f.Add("", "", []byte(""))
	f.Add("a,b", "  ", []byte("--boundary\r\n"))
	f.Fuzz(func(t *testing.T, channels, event string, data []byte) {
		want := &publishRequest{event: event, data: data}
		if channels != "" {
			want.channels = strings.Split(channels, "\x00")
		}
		h := &Handler{MaxChannels: DefaultMaxChannels, MaxEventSize: DefaultMaxEventSize}
		valid := h.validatePublish(&publishRequest{channels: slices.Clone(want.channels), event: event, data: data})
		if valid == nil {
			if err := h.validatePublish(want); err != nil {
				t.Fatal(err)
			}
		}
		for _, enc := range publishEncodings(t, want.channels, event, data) {
			r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(enc.body))
			r.Header.Set("Content-Type", enc.contentType)
			got, rej := h.readPublish(httptest.NewRecorder(), r)
			switch {
			case valid == nil && rej != nil:
				t.Fatalf("%s %q: refused %v; the request %+v is valid", enc.name, enc.body, rej, want)
			case valid != nil && rej == nil:
				t.Fatalf("%s %q: read as %+v; the request is not valid: %v", enc.name, enc.body, got, valid)
			case rej == nil && (!slices.Equal(got.channels, want.channels) || got.event != want.event || !bytes.Equal(got.data, want.data)):
				t.Fatalf("%s %q: read as %+v, want %+v", enc.name, enc.body, got, want)
			}
		}
	})
}

type publishEncoding struct {
	name, contentType string
	body              []byte
}

// publishEncodings are the bodies a client may send for a publish. JSON
// cannot carry text that is not UTF-8, so a request holding such text is
// only sent as forms.
func publishEncodings(t *testing.T, channels []string, event string, data []byte) []publishEncoding {
	t.Helper()
	var out []publishEncoding
	if utf8.ValidString(event) && utf8.Valid(data) && !slices.ContainsFunc(channels, func(c string) bool { return !utf8.ValidString(c) }) {
		list := map[string]any{"channel": channels, "data": string(data)}
		if channels == nil {
			delete(list, "channel")
		}
		if event != "" {
			list["event"] = event
		}
		out = append(out, publishEncoding{"json", "application/json", mustJSON(t, list)})
		if len(channels) == 1 {
			list["channel"] = channels[0]
			out = append(out, publishEncoding{"json, one channel", "application/json; charset=utf-8", mustJSON(t, list)})
		}
	}
	form := url.Values{"channel": channels, "data": {string(data)}}
	if event != "" {
		form.Set("event", event)
	}
	out = append(out, publishEncoding{"form", "application/x-www-form-urlencoded", []byte(form.Encode())})
	for _, asFile := range []bool{false, true} {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		for _, c := range channels {
			_ = mw.WriteField("channel", c)
		}
		if event != "" {
			_ = mw.WriteField("event", event)
		}
		if asFile {
			part, _ := mw.CreateFormFile("data", "event.json")
			_, _ = part.Write(data)
		} else {
			_ = mw.WriteField("data", string(data))
		}
		_ = mw.Close()
		out = append(out, publishEncoding{fmt.Sprintf("multipart (data as a file: %v)", asFile), mw.FormDataContentType(), body.Bytes()})
	}
	return out
}

// A publish's URL query plays no part in it: a form body (URL-encoded or
// multipart) is read alone, as a JSON body is, and is not refused for a
// query that net/http's form parser cannot parse (a semicolon, a bad
// escape), nor changed by fields the query names.
func TestAFormPublishIsReadWithoutTheURLQuery(t *testing.T) {
	h := &Handler{MaxChannels: DefaultMaxChannels, MaxEventSize: DefaultMaxEventSize}
	for _, query := range []string{"?a=1;b=2", "?x=%zz", "?channel=q&event=e&data=from+the+query"} {
		for _, enc := range publishEncodings(t, []string{"a"}, "t", []byte("x")) {
			t.Run(query+" "+enc.name, func(t *testing.T) {
				r := httptest.NewRequest(http.MethodPost, "/events"+query, bytes.NewReader(enc.body))
				r.Header.Set("Content-Type", enc.contentType)
				got, rej := h.readPublish(httptest.NewRecorder(), r)
				if rej != nil {
					t.Fatalf("refused: %v %s: %s", rej.status, rej.code, rej.detail)
				}
				if !slices.Equal(got.channels, []string{"a"}) || got.event != "t" || string(got.data) != "x" {
					t.Fatalf("read as %+v", got)
				}
			})
		}
	}
}

// readBody reads a body to its end whatever size was announced, and
// reports a body cut short.
func TestReadBodyReadsToTheEndWhateverTheAnnouncedSize(t *testing.T) {
	body := strings.Repeat("0123456789", 30)
	readers := map[string]func() io.Reader{
		"whole":             func() io.Reader { return strings.NewReader(body) },
		"a byte at a time":  func() io.Reader { return iotest.OneByteReader(strings.NewReader(body)) },
		"EOF with the data": func() io.Reader { return iotest.DataErrReader(strings.NewReader(body)) },
	}
	for name, reader := range readers {
		for _, size := range []int64{-1, 0, 1, 299, 300, 301, 5000, sizedReadMax + 1} {
			got, err := readBody(reader(), size)
			if err != nil || string(got) != body {
				t.Errorf("%s, announced %d: read %d bytes, %v", name, size, len(got), err)
			}
		}
	}
	cut := io.MultiReader(strings.NewReader(body[:100]), iotest.ErrReader(io.ErrUnexpectedEOF))
	if _, err := readBody(cut, 300); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a body cut short: %v", err)
	}
}

// A form publish has the fields channel, event and data only, as a JSON
// one does: another field is refused, not ignored. Ignored, a typo
// ("dat=") or another hub's name for a field (Mercure's "type=" for the
// event type) published the event without it, and a JSON body sent as a
// form (curl -d without a Content-Type) was refused as naming no channel.
func TestAFormPublishWithAnUnknownFieldIsRefused(t *testing.T) {
	h := &Handler{MaxChannels: DefaultMaxChannels, MaxEventSize: DefaultMaxEventSize}
	multipartBody := func(fields [][2]string, file string) (string, []byte) {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		for _, f := range fields {
			_ = mw.WriteField(f[0], f[1])
		}
		if file != "" {
			part, _ := mw.CreateFormFile(file, "x.json")
			_, _ = part.Write([]byte("{}"))
		}
		_ = mw.Close()
		return mw.FormDataContentType(), body.Bytes()
	}
	type request struct{ contentType, body, detail string }
	cases := map[string]request{
		"a typo":            {"application/x-www-form-urlencoded", "channel=a&dat=x", `"dat"`},
		"mercure's type":    {"application/x-www-form-urlencoded", "channel=a&type=invoice&data=x", `"type"`},
		"JSON sent as form": {"application/x-www-form-urlencoded", `{"channel":"a","data":"x"}`, "application/json"},
	}
	ct, body := multipartBody([][2]string{{"channel", "a"}, {"data", "x"}, {"id", "7"}}, "")
	cases["multipart field"] = request{ct, string(body), `"id"`}
	ct, body = multipartBody([][2]string{{"channel", "a"}}, "payload")
	cases["multipart file"] = request{ct, string(body), `"payload"`}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPost, "/events", strings.NewReader(tc.body))
			r.Header.Set("Content-Type", tc.contentType)
			got, rej := h.readPublish(httptest.NewRecorder(), r)
			if rej == nil {
				t.Fatalf("accepted as %+v", got)
			}
			if rej.status != http.StatusBadRequest || rej.code != "body_invalid" || !strings.Contains(rej.detail, tc.detail) {
				t.Fatalf("refused with %d %s %q, want 400 body_invalid naming %s", rej.status, rej.code, rej.detail, tc.detail)
			}
		})
	}
}
