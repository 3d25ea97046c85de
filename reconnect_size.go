package caddysse

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A browser's EventSource reconnects with the request it opened the stream
// with (its URL, which may list every channel, and its cookies) plus a
// Last-Event-ID naming a position for every channel. The server refuses a
// request whose line and headers exceed its max_header_size (431), and an
// EventSource takes that as final: a stream that fits when it opens but
// whose reconnect would not must be refused now, where its developer sees
// why, rather than left to break at its first reconnect.

// practicalEntryLen is the most bytes a channel's entry in a cursor
// takes in practice: its hash, a 32-bit epoch, a sequence below 2^35 and
// a time in milliseconds below 2^42 (replay/cursor.go); the varints'
// ceiling (replay's maxEntryLen) would refuse streams that will fit for
// centuries.
const practicalEntryLen = 4 + 5 + 5 + 6

// cursorTextLen is the length of a Last-Event-ID naming channels
// positions: base64url of a version byte, the entries and a check byte.
func cursorTextLen(channels int) int {
	return base64.RawURLEncoding.EncodedLen(2 + channels*practicalEntryLen)
}

// reconnectTooLarge refuses a stream whose reconnect would exceed the
// server's header limit as its protocol counts it: raw bytes of the
// request line and header lines, up to the blank line, on HTTP/1.x
// (net/http reads fewer than max_header_size and 4 KiB of slack), and the
// header list size on HTTP/2 (each field's name and value plus 32 bytes;
// at most max_header_size and 320) and on HTTP/3 (the same, at most
// max_header_size: quic-go checks the decoded fields so).
func reconnectTooLarge(r *http.Request, channels int) *rejection {
	srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil || srv.MaxHeaderBytes <= 0 {
		return nil
	}
	var size, limit int
	switch r.ProtoMajor {
	case 1:
		size, limit = http1ReconnectSize(r, channels), srv.MaxHeaderBytes+4096-1
	case 2:
		size, limit = fieldListReconnectSize(r, channels), srv.MaxHeaderBytes+320
	case 3:
		size, limit = fieldListReconnectSize(r, channels), srv.MaxHeaderBytes
	default:
		return nil
	}
	if size <= limit {
		return nil
	}
	return &rejection{status: http.StatusBadRequest, code: "too_many_channels", detail: fmt.Sprintf(
		"this stream's reconnect would send about %d bytes of request headers (its URL, headers and a Last-Event-ID for %d channels), "+
			"more than the server's max_header_size (%d) lets in: raise max_header_size or spread the channels over streams",
		size, channels, srv.MaxHeaderBytes)}
}

// http1ReconnectSize is the size of the request line and header lines of
// r's reconnect: r's, with a Last-Event-ID for channels instead of its own.
func http1ReconnectSize(r *http.Request, channels int) int {
	size := len(r.Method) + 1 + len(r.RequestURI) + 1 + len(r.Proto) + 2
	size += len("Host: ") + len(r.Host) + 2
	for name, values := range r.Header {
		if strings.EqualFold(name, "Last-Event-ID") {
			continue
		}
		for _, v := range values {
			size += len(name) + 2 + len(v) + 2
		}
	}
	return size + len("Last-Event-ID: ") + cursorTextLen(channels) + 2 + 2
}

// fieldListReconnectSize is the header list size (RFC 9113 6.5.2, RFC
// 9114 4.2.2) of r's reconnect: r's fields and pseudo-fields, with a
// Last-Event-ID for channels instead of its own.
func fieldListReconnectSize(r *http.Request, channels int) int {
	const perField = 32
	scheme := "https"
	if r.TLS == nil {
		scheme = "http"
	}
	size := len(":method") + len(r.Method) + len(":scheme") + len(scheme) +
		len(":authority") + len(r.Host) + len(":path") + len(r.RequestURI) + 4*perField
	for name, values := range r.Header {
		if strings.EqualFold(name, "Last-Event-ID") {
			continue
		}
		for _, v := range values {
			if name == "Cookie" {
				// sent as one field per cookie ("crumbs", RFC 9113
				// 8.2.3), which the server joined with "; "
				crumbs := strings.Count(v, "; ") + 1
				size += crumbs*(len(name)+perField) + len(v) - 2*(crumbs-1)
				continue
			}
			size += len(name) + len(v) + perField
		}
	}
	return size + len("last-event-id") + cursorTextLen(channels) + perField
}
