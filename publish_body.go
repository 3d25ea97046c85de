package caddysse

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddy-sse/caddy-sse/wire"
)

// publishRequest is a validated publish: the channels (as the publisher
// names them, without the namespace), the event type and the data.
type publishRequest struct {
	channels []string
	event    string
	data     []byte
}

// bodyOverhead is what a body may hold besides the event data and the
// channel names: the event type, JSON syntax and escapes.
const bodyOverhead = 64 << 10

// bodyLimit bounds a publish body. A JSON string may escape each byte into
// 6, so it is looser than max_event_size (the data itself is checked
// after), and it makes room for max_channels names of the longest kind: a
// valid publish to many long channels is not refused as too large.
func (h *Handler) bodyLimit() int64 {
	perChannel := int64(6*MaxChannelNameLen + len(`"",`))
	return 6*h.MaxEventSize + int64(h.MaxChannels)*perChannel + bodyOverhead
}

func badRequest(code, format string, args ...any) *rejection {
	return &rejection{status: http.StatusBadRequest, code: code, detail: fmt.Sprintf(format, args...)}
}

// readPublish reads and validates a publish body: JSON
// {"channel": "a" | ["a", ...], "event": "t", "data": <string | any JSON>}
// or form fields channel (repeatable), event and data.
func (h *Handler) readPublish(w http.ResponseWriter, r *http.Request) (*publishRequest, *rejection) {
	if ce := r.Header.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		// read as it is, a compressed body would be refused as malformed,
		// and a plain one labelled gzip published as if it were plain
		return nil, &rejection{status: http.StatusUnsupportedMediaType, code: "unsupported_media_type", detail: "send the body without a Content-Encoding"}
	}
	mediaType := r.Header.Get("Content-Type")
	if mediaType != "application/json" { // the usual one needs no parsing
		mediaType, _, _ = mime.ParseMediaType(mediaType)
	}
	limit := h.bodyLimit()
	body := r.Body
	r.Body = http.MaxBytesReader(w, body, limit)
	var req *publishRequest
	var rej *rejection
	switch {
	case mediaType == "application/json" || strings.HasSuffix(mediaType, "+json"):
		req, rej = readJSONPublish(r)
	case mediaType == "application/x-www-form-urlencoded" || mediaType == "multipart/form-data":
		req, rej = readFormPublish(r, mediaType, limit)
	default:
		// refused before a byte is read: the refusal does with the body
		// what it does for any (discardUnreadBody)
		r.Body = body
		return nil, &rejection{status: http.StatusUnsupportedMediaType, code: "unsupported_media_type", detail: "send application/json, application/x-www-form-urlencoded or multipart/form-data"}
	}
	if rej != nil {
		// what is left of the body is read here, all of it up to
		// maxDrain, not only up to the limit; a 100 Continue was asked for
		// by the read already, so the refusal does not read it again
		if r.ProtoMajor == 1 {
			drainRefused(w, body)
		}
		r.Body = http.NoBody
		return nil, rej
	}
	return req, h.validatePublish(req)
}

// maxDrain bounds what is read of a refused body.
const maxDrain = 8 << 20

// drainWait bounds the time a refused body is read for: one sent slowly
// (a byte now and then) held the handler and its connection for as long as
// its client liked. A client that needs longer sees its connection reset.
const drainWait = 2 * time.Second

// drainRefused reads what is left of a refused body (up to maxDrain, for at
// most drainWait), so that the client, still sending it, gets the refusal
// (a 413, a 401...): net/http closes the connection without reading the
// rest, and closing a socket with unread data resets it, which the client
// may see before the answer. The read deadline it sets ends with the
// request: net/http sets the connection's own for the next one.
func drainRefused(w http.ResponseWriter, body io.Reader) {
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(drainWait))
	_, _ = io.Copy(io.Discard, io.LimitReader(body, maxDrain))
}

// readError tells a body over the limit apart from other read errors.
func readError(err error) *rejection {
	var maxErr *http.MaxBytesError
	if errors.As(err, &maxErr) {
		return &rejection{status: http.StatusRequestEntityTooLarge, code: "event_too_large", detail: "the request body is too large"}
	}
	return badRequest("body_invalid", "reading the body: %v", err)
}

type jsonPublish struct {
	Channel json.RawMessage `json:"channel"`
	Event   json.RawMessage `json:"event"`
	Data    json.RawMessage `json:"data"`
}

// sizedReadMax is the largest body readBody reads into a buffer of its
// announced size at once; a larger one grows as it is read, so that a
// request that announces megabytes and sends little does not cost them.
const sizedReadMax = 64 << 10

// readBody reads a body of the announced size (-1 if unknown) into one
// buffer of that size: io.ReadAll's first buffer is 512 bytes whatever the
// body, most of it garbage for a small publish. A body longer than
// announced (a middleware may replace it) is still read to its end.
func readBody(body io.Reader, size int64) ([]byte, error) {
	if size <= 0 || size > sizedReadMax {
		return io.ReadAll(body)
	}
	buf := make([]byte, 0, size+1) // +1: room for the read that finds the end
	for {
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		switch {
		case err == io.EOF:
			return buf, nil
		case err != nil:
			return buf, err
		case len(buf) == cap(buf):
			rest, err := io.ReadAll(body)
			return append(buf, rest...), err
		}
	}
}

func readJSONPublish(r *http.Request) (*publishRequest, *rejection) {
	body, err := readBody(r.Body, r.ContentLength)
	if err != nil {
		return nil, readError(err)
	}
	// encoding/json silently replaces invalid UTF-8 with U+FFFD: refuse it
	// instead of publishing something else than what was sent
	if !utf8.Valid(body) {
		return nil, badRequest("body_invalid", "the body is not valid UTF-8")
	}
	in, err := decodeJSONPublish(body)
	if err != nil {
		return nil, badRequest("json_invalid", "%v", err)
	}
	req := &publishRequest{}
	var rej *rejection
	if req.event, rej = jsonEvent(in.Event); rej != nil {
		return nil, rej
	}
	if req.channels, rej = jsonChannels(in.Channel); rej != nil {
		return nil, rej
	}
	if req.data, rej = jsonData(in.Data); rej != nil {
		return nil, rej
	}
	return req, nil
}

// decodeJSONPublish reads the body's one JSON object strictly: the fields
// channel, event and data, each at most once and spelt exactly so, and
// nothing after the object. encoding/json alone would take the last of a
// repeated field, "Channel" for "channel", and stop before a stray "}":
// what a proxy or a log in front read might not be what is published.
func decodeJSONPublish(body []byte) (jsonPublish, error) {
	if in, ok := splitPublishObject(body); ok {
		return in, nil // the usual body, read without garbage
	}
	return decodeJSONPublishTokens(body)
}

// decodeJSONPublishTokens is decodeJSONPublish token by token with
// encoding/json: any body, and the refusal of a bad one.
func decodeJSONPublishTokens(body []byte) (jsonPublish, error) {
	var in jsonPublish
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return in, errors.New("the body must be one JSON object")
	}
	fields := map[string]*json.RawMessage{"channel": &in.Channel, "event": &in.Event, "data": &in.Data}
	seen := make(map[string]bool, len(fields))
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return in, err
		}
		name, _ := tok.(string)
		switch field := fields[name]; {
		case field == nil:
			return in, fmt.Errorf("unknown field %q", name)
		case seen[name]:
			return in, fmt.Errorf("field %q given twice", name)
		default:
			seen[name] = true
			if err := dec.Decode(field); err != nil {
				return in, err
			}
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return in, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return in, errors.New("trailing data after the JSON object")
	}
	return in, nil
}

// jsonEvent returns the event type, a string.
func jsonEvent(raw json.RawMessage) (string, *rejection) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if plain, ok := plainJSONString(raw); ok {
		return string(plain), nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", badRequest("event_invalid", `"event" must be a string`)
	}
	if hasLoneSurrogate(raw) {
		return "", badRequest("event_invalid", `"event" holds an unpaired UTF-16 surrogate escape`)
	}
	return s, nil
}

func jsonChannels(raw json.RawMessage) ([]string, *rejection) {
	if len(raw) == 0 {
		return nil, nil // reported as channel_missing
	}
	if plain, ok := plainJSONString(raw); ok {
		return []string{string(plain)}, nil
	}
	if list, ok := plainJSONStrings(raw); ok {
		return list, nil
	}
	if hasLoneSurrogate(raw) {
		// encoding/json would name another channel (U+FFFD for it)
		return nil, badRequest("channel_invalid", `"channel" holds an unpaired UTF-16 surrogate escape`)
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err == nil {
		return many, nil
	}
	return nil, badRequest("channel_invalid", `"channel" must be a string or an array of strings`)
}

// jsonData returns a string's text, or any other JSON value as compact
// JSON; raw is a valid JSON value (decodeJSONPublish read it).
func jsonData(raw json.RawMessage) ([]byte, *rejection) {
	if len(raw) == 0 {
		return []byte{}, nil
	}
	if raw[0] != '"' {
		return appendCompactJSON(nil, raw), nil
	}
	if plain, ok := plainJSONString(raw); ok {
		return bytes.Clone(plain), nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, badRequest("json_invalid", "%v", err)
	}
	if hasLoneSurrogate(raw) {
		return nil, badRequest("data_invalid", `"data" holds an unpaired UTF-16 surrogate escape`)
	}
	return []byte(s), nil
}

// hasLoneSurrogate reports whether the JSON text raw has a \u escape of a
// UTF-16 surrogate (D800-DFFF) that is not half of a pair: encoding/json
// decodes it as U+FFFD, which would publish something else than was sent.
// Escapes are read as JSON does, so an escaped backslash followed by
// "ud800" is text, not an escape.
func hasLoneSurrogate(raw []byte) bool {
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' || i+1 >= len(raw) {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // a two-character escape: its second byte is not a backslash
			continue
		}
		u, ok := hex4(raw, i+2)
		switch {
		case !ok:
			return false // not valid JSON: the decoder has refused it already
		case u >= 0xDC00 && u <= 0xDFFF:
			return true // a low half alone
		case u >= 0xD800 && u <= 0xDBFF:
			low, ok := 0, false
			if i+11 < len(raw) && raw[i+6] == '\\' && raw[i+7] == 'u' {
				low, ok = hex4(raw, i+8)
			}
			if !ok || low < 0xDC00 || low > 0xDFFF {
				return true // a high half without its low half
			}
			i += 11
		default:
			i += 5
		}
	}
	return false
}

// hex4 reads the four hex digits at raw[at:].
func hex4(raw []byte, at int) (int, bool) {
	if at+4 > len(raw) {
		return 0, false
	}
	n, err := strconv.ParseUint(string(raw[at:at+4]), 16, 16)
	return int(n), err == nil
}

func readFormPublish(r *http.Request, mediaType string, limit int64) (*publishRequest, *rejection) {
	// the body alone: the URL's query plays no part in a publish, and
	// r.ParseForm, which parses it too, would refuse a valid body for a
	// query it cannot parse (a semicolon, a bad escape) that JSON ignores
	var form url.Values
	var files map[string][]*multipart.FileHeader
	if mediaType == "multipart/form-data" {
		mr, err := r.MultipartReader()
		if err != nil {
			return nil, readError(err)
		}
		mf, err := mr.ReadForm(limit)
		if err != nil {
			return nil, readError(err)
		}
		defer mf.RemoveAll()
		form, files = mf.Value, mf.File
	} else {
		body, err := readBody(r.Body, r.ContentLength)
		if err != nil {
			return nil, readError(err)
		}
		if form, err = url.ParseQuery(string(body)); err != nil {
			return nil, readError(err)
		}
	}
	if rej := unknownFormField(form, files); rej != nil {
		return nil, rej
	}
	req := &publishRequest{channels: form["channel"], event: form.Get("event"), data: []byte(form.Get("data"))}
	if len(form["event"]) > 1 || len(form["data"]) > 1 {
		return nil, badRequest("body_invalid", "event and data may be given once")
	}
	if files != nil {
		if rej := fileData(req, files, len(form["data"]) > 0); rej != nil {
			return nil, rej
		}
	}
	if !utf8.ValidString(req.event) {
		return nil, badRequest("event_invalid", "the event type must be valid UTF-8")
	}
	if !utf8.Valid(req.data) {
		return nil, badRequest("data_invalid", "data must be valid UTF-8")
	}
	return req, nil
}

// unknownFormField refuses a form with a field other than channel, event
// and data, as a JSON body is refused for one: ignored, a typo ("dat=") or
// another hub's name for a field (Mercure's "type=") would publish the
// event without it. A JSON body sent as a form (curl -d without a
// Content-Type) is one such field: told so.
func unknownFormField(form url.Values, files map[string][]*multipart.FileHeader) *rejection {
	var unknown []string
	for name := range form {
		if !publishField(name) {
			unknown = append(unknown, name)
		}
	}
	for name := range files {
		if !publishField(name) {
			unknown = append(unknown, name)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	name := unknown[0]
	if t := strings.TrimSpace(name); strings.HasPrefix(t, "{") || strings.HasPrefix(t, "[") {
		return badRequest("body_invalid", "the form body looks like JSON: send it with Content-Type: application/json")
	}
	return badRequest("body_invalid", "unknown form field %q: a publish has only channel, event and data", name)
}

func publishField(name string) bool {
	return name == "channel" || name == "event" || name == "data"
}

// fileData takes the data from a file part (`curl -F data=@event.json`);
// channel and event must be plain fields. A file part is otherwise left out
// of the form's values, and the event would be published empty.
func fileData(req *publishRequest, files map[string][]*multipart.FileHeader, dataField bool) *rejection {
	if len(files["channel"]) > 0 || len(files["event"]) > 0 {
		return badRequest("body_invalid", "channel and event must be plain fields, not files")
	}
	parts := files["data"]
	switch {
	case len(parts) == 0:
		return nil
	case len(parts) > 1 || dataField:
		return badRequest("body_invalid", "event and data may be given once")
	}
	f, err := parts[0].Open()
	if err != nil {
		return badRequest("body_invalid", "reading the data part: %v", err)
	}
	defer f.Close()
	if req.data, err = io.ReadAll(f); err != nil {
		return badRequest("body_invalid", "reading the data part: %v", err)
	}
	return nil
}

// validatePublish checks the channels, event type and data size, and drops
// duplicate channels (an event is published once per channel).
func (h *Handler) validatePublish(req *publishRequest) *rejection {
	if len(req.channels) == 0 {
		return badRequest("channel_missing", "name at least one channel")
	}
	seen := make(map[string]bool, len(req.channels))
	unique := req.channels[:0:0]
	for _, c := range req.channels {
		if err := h.validateChannel(c); err != nil {
			return badRequest("channel_invalid", "%q: %v", c, err)
		}
		if !seen[c] {
			seen[c] = true
			unique = append(unique, c)
		}
	}
	req.channels = unique
	if len(req.channels) > h.MaxChannels { // counted once each, as they are published
		return badRequest("too_many_channels", "%d channels, at most %d", len(req.channels), h.MaxChannels)
	}
	switch {
	case wire.IsReservedType(req.event):
		return badRequest("event_reserved", "%q is an event type of the module itself", req.event)
	case !wire.ValidEventType(req.event):
		return badRequest("event_invalid", "an event type must be at most %d bytes of UTF-8 without line breaks", wire.MaxEventTypeLen)
	case int64(len(req.data)) > h.MaxEventSize:
		return &rejection{status: http.StatusRequestEntityTooLarge, code: "event_too_large", detail: fmt.Sprintf("data is %d bytes, at most %d", len(req.data), h.MaxEventSize)}
	case !utf8.Valid(req.data):
		return badRequest("data_invalid", "data must be valid UTF-8")
	}
	return nil
}
