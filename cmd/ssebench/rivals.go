package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// The reference figures are of other SSE servers (Nchan, Mercure,
// Pushpin, Centrifugo). The same scenarios measure them side by side on
// this machine: -publish-as names the server's publish API, -url its
// subscribe URL (with {ch}), and the events carry the same timestamped
// data, which the tool finds in whatever the server wraps it in.

// rivals are the publish APIs -publish-as knows besides caddy-sse's own.
var rivals = []string{"nchan", "mercure", "pushpin", "centrifugo"}

// rivalPublisher publishes one event through another server's API.
type rivalPublisher struct {
	kind   string
	raw    string // the publish URL; nchan's holds {ch}
	host   string // the Host header
	secret string // mercure: the publisher JWT's key; centrifugo: the API key
	jwt    string // mercure: the publisher JWT
	client *http.Client
	tr     *http.Transport
}

func newRivalPublisher(kind string, t *target, secret string, conns int, timeout time.Duration) *rivalPublisher {
	tr := publishTransport(t, conns, timeout)
	p := &rivalPublisher{kind: kind, raw: t.raw, host: t.host, secret: secret, tr: tr,
		client: &http.Client{Transport: tr, Timeout: timeout}}
	if kind == "mercure" {
		p.jwt = hs256JWT(secret, `{"mercure":{"publish":["*"]}}`)
	}
	return p
}

// hs256JWT signs claims (a JSON object) with key, as Mercure's
// publisher_jwt <key> HS256 expects (the header is the one of Mercure's
// documentation).
func hs256JWT(key, claims string) string {
	enc := base64.RawURLEncoding
	unsigned := enc.EncodeToString([]byte(`{"alg":"HS256"}`)) + "." + enc.EncodeToString([]byte(claims))
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(unsigned))
	return unsigned + "." + enc.EncodeToString(mac.Sum(nil))
}

func (p *rivalPublisher) publish(ctx context.Context, channel, event string, data []byte, _ string) error {
	req, err := p.request(ctx, channel, event, data)
	if err != nil {
		return err
	}
	req.Host = p.host
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("publish: %s", shortErr(err))
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("publish: status %d %s", resp.StatusCode, bytes.TrimSpace(reply))
	}
	if p.kind == "centrifugo" && bytes.Contains(reply, []byte(`"error"`)) {
		return fmt.Errorf("publish: %s", bytes.TrimSpace(reply))
	}
	return nil
}

// request builds the publish request of the server's API:
//   - nchan: POST /pub/<channel> (nchan_publisher), the body is the data,
//     X-EventSource-Event the type;
//   - mercure: POST /.well-known/mercure, a form with topic, data and type,
//     a publisher JWT;
//   - pushpin: POST /publish/ on the handler's port (GRIP), the event as
//     an http-stream item;
//   - centrifugo: POST /api/publish with the API key, the data as JSON.
func (p *rivalPublisher) request(ctx context.Context, channel, event string, data []byte) (*http.Request, error) {
	var body []byte
	var contentType string
	target := p.raw
	switch p.kind {
	case "nchan":
		target = strings.ReplaceAll(p.raw, "{ch}", url.PathEscape(channel))
		body, contentType = data, "application/json"
	case "mercure":
		body = []byte(url.Values{"topic": {channel}, "data": {string(data)}, "type": {event}}.Encode())
		contentType = "application/x-www-form-urlencoded"
	case "pushpin":
		content := "event: " + event + "\ndata: " + string(data) + "\n\n"
		item := map[string]any{"channel": channel, "formats": map[string]any{"http-stream": map[string]string{"content": content}}}
		var err error
		if body, err = json.Marshal(map[string]any{"items": []any{item}}); err != nil {
			return nil, err
		}
		contentType = "application/json"
	case "centrifugo":
		var err error
		if body, err = json.Marshal(map[string]any{"channel": channel, "data": json.RawMessage(data)}); err != nil {
			return nil, err
		}
		contentType = "application/json"
	default:
		return nil, fmt.Errorf("-publish-as %q: unknown", p.kind)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", contentType)
	switch p.kind {
	case "nchan":
		req.Header.Set("X-EventSource-Event", event)
	case "mercure":
		req.Header.Set("Authorization", "Bearer "+p.jwt)
	case "centrifugo":
		req.Header.Set("X-API-Key", p.secret)
	}
	return req, nil
}

func (p *rivalPublisher) close() { p.tr.CloseIdleConnections() }

// runGripBackend serves the backend Pushpin proxies streams to (its routes
// file names it): GET /stream/<channel> answers with GRIP headers that make
// Pushpin hold the response open as an SSE stream subscribed to the
// channel, after a ": ok" comment; Pushpin then sends what is published to
// the channel (POST /publish/ on its handler's port) to every such stream.
func runGripBackend(args []string) int {
	fs := flag.NewFlagSet("grip-backend", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:9098", "listen address (loopback only)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := checkLoopbackAddr(context.Background(), *addr, defaultLookup); err != nil {
		fmt.Fprintln(os.Stderr, "grip-backend:", err)
		return 2
	}
	srv := &http.Server{Addr: *addr, Handler: gripHandler(), ReadHeaderTimeout: 10 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, "grip-backend:", err)
		return 1
	}
	return 0
}

// gripHandler answers GET /stream/<channel> with the GRIP instructions
// (runGripBackend).
func gripHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stream/{channel}", func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Grip-Hold", "stream")
		h.Set("Grip-Channel", r.PathValue("channel"))
		_, _ = io.WriteString(w, ": ok\n\n")
	})
	return mux
}
