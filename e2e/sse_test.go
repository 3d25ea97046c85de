package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// sseEvent is an event dispatched by the WHATWG event stream parser.
type sseEvent struct {
	// Type is "message" when the stream named none, and empty for a block
	// that only set the last event ID (an id line and no data, as the
	// module's opening ends with): nothing dispatches, but an EventSource
	// sends that id when it reconnects
	Type  string
	Data  string
	ID    string // the stream's last event ID once this event dispatched
	HasID bool   // the event's block had an id field
	Retry int    // the retry field in the event's block, in ms; -1 if none
}

func (e sseEvent) String() string {
	s := fmt.Sprintf("{type=%q data=%q", e.Type, e.Data)
	if e.HasID {
		s += fmt.Sprintf(" id=%q", e.ID)
	}
	if e.Retry >= 0 {
		s += fmt.Sprintf(" retry=%d", e.Retry)
	}
	return s + "}"
}

// sseParser implements the WHATWG "interpret an event stream" algorithm
// (https://html.spec.whatwg.org/multipage/server-sent-events.html) over
// complete lines.
type sseParser struct {
	eventType   string
	data        strings.Builder
	lastID      string // the last event ID buffer
	hasID       bool
	blockRetry  int
	reconnectMS int // the reconnection time, -1 until a retry field sets it
	comments    []string
}

func newSSEParser() *sseParser { return &sseParser{blockRetry: -1, reconnectMS: -1} }

// line processes one line (without its terminator). It returns an event
// when the line dispatched one, and whether the line was blank (a dispatch
// point, even if no event came of it).
func (p *sseParser) line(l string) (ev *sseEvent, blank bool) {
	if l == "" {
		return p.dispatch(), true
	}
	if strings.HasPrefix(l, ":") {
		p.comments = append(p.comments, l[1:])
		return nil, false
	}
	field, value := l, ""
	if i := strings.IndexByte(l, ':'); i >= 0 {
		field, value = l[:i], l[i+1:]
		value = strings.TrimPrefix(value, " ")
	}
	switch field {
	case "event":
		p.eventType = value
	case "data":
		p.data.WriteString(value)
		p.data.WriteByte('\n')
	case "id":
		if !strings.ContainsRune(value, 0) {
			p.lastID = value
			p.hasID = true
		}
	case "retry":
		if n, err := strconv.Atoi(value); err == nil && n >= 0 && strings.Trim(value, "0123456789") == "" {
			p.reconnectMS = n
			p.blockRetry = n
		}
	}
	return nil, false
}

func (p *sseParser) dispatch() *sseEvent {
	retry, hasID := p.blockRetry, p.hasID
	p.blockRetry, p.hasID = -1, false
	if p.data.Len() == 0 {
		p.eventType = ""
		return nil
	}
	data := strings.TrimSuffix(p.data.String(), "\n")
	typ := p.eventType
	if typ == "" {
		typ = "message"
	}
	p.data.Reset()
	p.eventType = ""
	return &sseEvent{Type: typ, Data: data, ID: p.lastID, HasID: hasID, Retry: retry}
}

// readLines splits r into lines ended by CRLF, LF or CR, as the event
// stream format does, and calls fn for each complete line. A trailing
// incomplete line is dropped. It returns io.EOF at a clean end.
func readLines(r io.Reader, fn func(string)) error {
	br := bufio.NewReader(r)
	var line bytes.Buffer
	skipLF := false
	// a leading UTF-8 BOM is ignored
	if b, err := br.Peek(3); err == nil && bytes.Equal(b, []byte("\xEF\xBB\xBF")) {
		_, _ = br.Discard(3)
	}
	for {
		c, err := br.ReadByte()
		if err != nil {
			return err
		}
		if skipLF {
			skipLF = false
			if c == '\n' {
				continue
			}
		}
		switch c {
		case '\r':
			skipLF = true
			fallthrough
		case '\n':
			fn(line.String())
			line.Reset()
		default:
			line.WriteByte(c)
		}
	}
}

// sseConn is an open event stream whose events are parsed in a goroutine
// and delivered on a channel.
type sseConn struct {
	name   string
	resp   *http.Response
	ctx    context.Context // canceled by close
	cancel context.CancelFunc
	events chan sseEvent

	preamble  chan struct{} // closed at the stream's first blank line
	firstLine string        // set before preamble is closed
	openRetry int           // reconnection time at the first blank line

	done chan struct{} // closed when the body ended; events is drained after
	err  error         // io.EOF for a clean end; set before done is closed

	mu     sync.Mutex
	lastID string // the last event ID of the events taken with next
}

// openStream opens an event stream with GET url (lastID, if not empty, as
// Last-Event-ID), checks its status and headers and waits for its preamble
// (the initial comment and retry), so that the stream is subscribed when it
// returns. The stream is closed when the test ends.
func openStream(t *testing.T, client *http.Client, url, lastID string) *sseConn {
	t.Helper()
	c, err := tryOpenStream(client, url, lastID, time.Now().Add(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	return c
}

func tryOpenStream(client *http.Client, url, lastID string, deadline time.Time) (*sseConn, error) {
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	req.Header.Set("Accept", "text/event-stream")
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	timer := time.AfterFunc(time.Until(deadline), cancel)
	resp, err := client.Do(req)
	if err != nil {
		timer.Stop()
		cancel()
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		_ = resp.Body.Close()
		timer.Stop()
		cancel()
		return nil, fmt.Errorf("GET %s: status %d, want 200: %s", url, resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		_ = resp.Body.Close()
		timer.Stop()
		cancel()
		return nil, fmt.Errorf("GET %s: Content-Type %q, want text/event-stream", url, ct)
	}
	c := &sseConn{
		name:     url,
		resp:     resp,
		ctx:      ctx,
		cancel:   cancel,
		events:   make(chan sseEvent, 1024),
		preamble: make(chan struct{}),
		done:     make(chan struct{}),
		lastID:   lastID,
	}
	go c.read(lastID)
	select {
	case <-c.preamble:
		timer.Stop()
		return c, nil
	case <-c.done:
		timer.Stop()
		select {
		case <-c.preamble: // a short body ended right after it: both were ready
			return c, nil
		default:
		}
		return nil, fmt.Errorf("GET %s: stream ended before its preamble: %v", url, c.err)
	}
}

// read parses the stream. Its last event ID buffer starts at the id the
// connection was opened with, as EventSource's does (browsers seed a
// reconnection's parser with it): an event without an id on this
// connection — server_closing before any replayed or live event — keeps
// the client's position, where an empty buffer made the next reconnect a
// fresh one that skipped what was published meanwhile.
func (c *sseConn) read(lastID string) {
	defer close(c.done)
	defer c.resp.Body.Close()
	p := newSSEParser()
	p.lastID = lastID
	first := true
	preambled := false
	dispatched := lastID // the last event ID as of the last blank line
	err := readLines(c.resp.Body, func(l string) {
		if first {
			c.firstLine, first = l, false
		}
		ev, blank := p.line(l)
		if blank && !preambled {
			c.openRetry = p.reconnectMS
			preambled = true
			close(c.preamble)
		}
		if blank && ev == nil && p.lastID != dispatched {
			ev = &sseEvent{ID: p.lastID, HasID: true, Retry: -1} // an id-only block
		}
		if blank {
			dispatched = p.lastID
		}
		if ev != nil {
			select {
			case c.events <- *ev:
			case <-c.ctx.Done(): // abandoned: do not block its close
			}
		}
	})
	c.err = err
}

// close abandons the stream.
func (c *sseConn) close() {
	c.cancel()
	<-c.done
}

// next returns the stream's next event, or an error if the stream ends or
// deadline passes first. An id-only block on the way moves the stream's
// last event ID, as it does an EventSource's.
func (c *sseConn) next(deadline time.Time) (sseEvent, error) {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		ev, err := c.receive(timer.C)
		if err != nil {
			return ev, err
		}
		c.took(ev)
		if ev.Type != "" {
			return ev, nil
		}
	}
}

// receive returns the stream's next block, events already parsed before
// the stream's end or the timeout.
func (c *sseConn) receive(timeout <-chan time.Time) (sseEvent, error) {
	select {
	case ev := <-c.events:
		return ev, nil
	default:
	}
	select {
	case ev := <-c.events:
		return ev, nil
	case <-c.done:
		select {
		case ev := <-c.events:
			return ev, nil
		default:
		}
		return sseEvent{}, fmt.Errorf("stream ended (%v) while waiting for an event", c.err)
	case <-timeout:
		return sseEvent{}, errors.New("no event before the deadline")
	}
}

func (c *sseConn) took(ev sseEvent) {
	c.mu.Lock()
	c.lastID = ev.ID
	c.mu.Unlock()
}

// lastEventID is what an EventSource would send as Last-Event-ID now.
func (c *sseConn) lastEventID() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastID
}

// expectEnd waits until the stream ends cleanly (EOF) and checks that no
// event came before the end.
func (c *sseConn) expectEnd(deadline time.Time) error {
	select {
	case <-c.done:
	case <-time.After(time.Until(deadline)):
		return errors.New("stream did not end before the deadline")
	}
	for {
		select {
		case ev := <-c.events:
			c.took(ev)
			if ev.Type != "" {
				return fmt.Errorf("unexpected event before the end of the stream: %v", ev)
			}
			continue
		default:
		}
		break
	}
	if !errors.Is(c.err, io.EOF) {
		return fmt.Errorf("stream ended with %v, want a clean EOF", c.err)
	}
	return nil
}

// expectData reads the next len(want) events and checks they are messages
// with an id and the wanted data, in order.
func (c *sseConn) expectData(deadline time.Time, want ...string) error {
	for i, w := range want {
		ev, err := c.next(deadline)
		if err != nil {
			return fmt.Errorf("event %d of %q: %v", i+1, want, err)
		}
		if ev.Type != "message" || ev.Data != w || !ev.HasID || ev.ID == "" {
			return fmt.Errorf("event %d of %q: got %v, want a message with data %q and an id", i+1, want, ev, w)
		}
	}
	return nil
}

// expectClosing reads the next event and checks that it is server_closing
// with the given reason, no id, and a retry within [0, maxRetry].
func (c *sseConn) expectClosing(deadline time.Time, reason string, maxRetry time.Duration) (retry int, err error) {
	ev, err := c.next(deadline)
	if err != nil {
		return -1, fmt.Errorf("waiting for server_closing: %v", err)
	}
	if ev.Type != "server_closing" {
		return -1, fmt.Errorf("got %v, want event server_closing", ev)
	}
	var body map[string]any
	if err := json.Unmarshal([]byte(ev.Data), &body); err != nil || len(body) != 1 || body["reason"] != reason {
		return -1, fmt.Errorf("server_closing data %q, want {\"reason\":%q}", ev.Data, reason)
	}
	if ev.HasID {
		return -1, fmt.Errorf("server_closing has an id line (%q): it would move the client's Last-Event-ID", ev.ID)
	}
	if ev.Retry < 0 || ev.Retry > int(maxRetry.Milliseconds()) {
		return -1, fmt.Errorf("server_closing retry = %d ms, want a retry field within [0, %d]", ev.Retry, maxRetry.Milliseconds())
	}
	return ev.Retry, nil
}

// publish publishes data to channel and returns the id of the event.
func publish(t *testing.T, client *http.Client, url, secret, channel, data string) string {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"channel": channel, "data": data})
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+secret)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("publishing %q to %q: %v", data, channel, err)
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("publishing %q to %q: status %d: %s", data, channel, resp.StatusCode, reply)
	}
	var ids struct {
		IDs map[string]string `json:"ids"`
	}
	if err := json.Unmarshal(reply, &ids); err != nil || ids.IDs[channel] == "" {
		t.Fatalf("publishing %q to %q: reply %s has no id for the channel (%v)", data, channel, reply, err)
	}
	return ids.IDs[channel]
}

// forAll runs check for every stream concurrently and fails the test with
// every error (prefixed with the stream's index).
func forAll(t *testing.T, streams []*sseConn, check func(i int, c *sseConn) error) {
	t.Helper()
	errs := make([]error, len(streams))
	var wg sync.WaitGroup
	for i, c := range streams {
		wg.Go(func() { errs[i] = check(i, c) })
	}
	wg.Wait()
	failed := 0
	for i, err := range errs {
		if err != nil {
			failed++
			if failed <= 10 {
				t.Errorf("stream %d: %v", i, err)
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d streams failed", failed, len(streams))
	}
}

// h1Client returns a client that speaks HTTP/1.1. Streams use keep-alive
// connections as browsers do. Publishers use fresh connections: a POST is
// not retried by net/http if it goes out on a kept-alive connection that a
// stopping server has just closed.
func h1Client(t *testing.T, keepAlive bool) *http.Client {
	tr := &http.Transport{DisableKeepAlives: !keepAlive, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}
