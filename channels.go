package caddysse

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/replay"
)

// MaxChannelNameLen bounds a channel name (SPEC S1).
const MaxChannelNameLen = 200

// validateChannelName checks a channel name: 1 to 200 bytes of UTF-8, no
// control characters, none of "{", "}" (they delimit Redis hash tags) or
// "," (it separates the channels of a template), and no white space at
// either end (subscribe trims what templates resolve to: a publish to
// "a " would reach no stream).
func validateChannelName(name string) error {
	switch {
	case name == "":
		return errors.New("empty channel name")
	case len(name) > MaxChannelNameLen:
		return fmt.Errorf("channel name longer than %d bytes", MaxChannelNameLen)
	case !utf8.ValidString(name):
		return errors.New("channel name is not valid UTF-8")
	case strings.TrimSpace(name) != name:
		return errors.New("channel name starts or ends with white space")
	}
	for _, r := range name {
		switch {
		case unicode.IsControl(r):
			return errors.New("channel name contains a control character")
		case r == '{' || r == '}' || r == ',':
			return fmt.Errorf("channel name contains %q", r)
		}
	}
	return nil
}

// validateChannel checks a channel name as this handler names it: valid,
// and no longer than a channel name may be once namespaced (SPEC S1 bounds
// the name events are published to). A namespaced route used to take 200
// bytes before its namespace, a channel no route without one could name.
func (h *Handler) validateChannel(name string) error {
	if err := validateChannelName(name); err != nil {
		return err
	}
	if h.Namespace != "" && len(h.Namespace)+1+len(name) > MaxChannelNameLen {
		return fmt.Errorf("channel name longer than %d bytes with its namespace %q", MaxChannelNameLen, h.Namespace+":")
	}
	return nil
}

// validateNamespace checks a namespace: a valid channel name without ':'
// (it is followed by one in every channel it prefixes).
func validateNamespace(ns string) error {
	if err := validateChannelName(ns); err != nil || strings.Contains(ns, ":") {
		return fmt.Errorf("namespace %q: must be a valid channel name without ':'", ns)
	}
	return nil
}

// rejection is a refused request: status, error code and, for temporary
// refusals, how long to wait.
type rejection struct {
	status int
	code   string
	detail string
}

func (r *rejection) Error() string { return r.code + ": " + r.detail }

// resolveChannels turns the handler's templates into the channel names of
// one request, in order and without duplicates, or the reason to refuse it
// (SPEC S2 step 2).
func (h *Handler) resolveChannels(r *http.Request, repl *caddy.Replacer) ([]string, *rejection) {
	var names []string
	seen := make(map[string]struct{}, len(h.channelTemplates))
	add := func(name string) *rejection {
		name = strings.TrimSpace(name)
		if err := h.validateChannel(name); err != nil {
			return &rejection{status: 400, code: "channel_invalid", detail: err.Error()}
		}
		if len(names) > h.MaxChannels {
			// refused already: the rest are only checked, not kept (a
			// query of a million items would otherwise cost a million
			// strings before its 400)
			return nil
		}
		if _, dup := seen[name]; !dup {
			seen[name] = struct{}{}
			names = append(names, name)
		}
		return nil
	}
	// an unresolved template (403) is told before an invalid name (400),
	// whichever template comes first, as SPEC S2 orders them
	var invalid *rejection
	for _, tmpl := range h.channelTemplates {
		rej := tmpl.channels(r, repl, add)
		switch {
		case rej == nil:
		case rej.status == http.StatusForbidden:
			return nil, rej
		case invalid == nil:
			invalid = rej
		}
	}
	if invalid != nil {
		return nil, invalid
	}
	if len(names) > h.MaxChannels {
		return nil, &rejection{status: 400, code: "too_many_channels", detail: fmt.Sprintf("more than %d channels", h.MaxChannels)}
	}
	return names, nil
}

// collidingChannels refuses a stream two of whose channels have the same
// hash (replay.HashChannel of their names in the hub, with the namespace):
// its ids name channels by that hash, so the two would get each other's
// positions, and every reconnect would be told truncated and replay
// duplicates. Names can come from user input, and 32 bits collide.
func collidingChannels(names []string, cursor []replay.ChannelPosition) *rejection {
	collide := func(i, j int) *rejection {
		return &rejection{status: 400, code: "channel_invalid", detail: fmt.Sprintf(
			"channels %q and %q have the same hash in the stream's ids and cannot share a stream: subscribe to them on separate streams",
			names[i], names[j])}
	}
	if len(cursor) <= 16 {
		for j := 1; j < len(cursor); j++ {
			for i := 0; i < j; i++ {
				if cursor[i].Hash == cursor[j].Hash {
					return collide(i, j)
				}
			}
		}
		return nil
	}
	seen := make(map[uint32]int, len(cursor))
	for j, c := range cursor {
		if i, ok := seen[c.Hash]; ok {
			return collide(i, j)
		}
		seen[c.Hash] = j
	}
	return nil
}

// channels gives add the channel names a template resolves to. Commas in
// the template's own text separate channels; a query placeholder whose
// value is a comma-separated list (or a repeated parameter) names one
// channel per item, each with the template's text around it:
// public:{query.topics} with topics=a,b is public:a and public:b, never
// public:a and b — the template's text is what confines a client to its
// channels. One placeholder per channel may be a list.
//
// Only the query lists channels: it is where a client chooses them. Any
// other value — a header, a user id from authentication, a client
// certificate's subject (which holds commas), a variable — names one
// channel, whole: split, user:{http.auth.user.id} would give a user named
// "alice,bob" bob's channel. A comma makes that one name invalid (400).
func (t template) channels(r *http.Request, repl *caddy.Replacer, add func(string) *rejection) *rejection {
	if t.parts == nil { // escaped or nested braces: the replacer's whole value
		value, ok := t.resolve(r, repl)
		if !ok || strings.TrimSpace(value) == "" {
			return t.unresolved()
		}
		return add(value)
	}
	// an invalid item (400) is told only once every placeholder resolved:
	// an unresolved one (403) comes first (SPEC S2 step 2)
	var item channelItem
	var invalid *rejection
	keep := func(rej *rejection) {
		if invalid == nil {
			invalid = rej
		}
	}
	for _, p := range t.parts {
		value, ok := p.resolve(r, repl)
		switch {
		case p.kind == partLiteral:
			pieces := strings.Split(value, ",")
			item.text(pieces[0])
			for _, piece := range pieces[1:] {
				keep(item.emit(add))
				item = channelItem{}
				item.text(piece)
			}
		case !ok || strings.TrimSpace(value) == "":
			return t.unresolved() // a blank value names no channel: seed 002
		case strings.Contains(value, ",") && p.kind == partQuery:
			keep(item.list(t.raw, value))
		case strings.Contains(value, ","):
			keep(&rejection{status: 400, code: "channel_invalid", detail: fmt.Sprintf(
				"template %q: the value of %s holds a comma; only a query parameter may list channels", t.raw, p.name())})
		default:
			item.text(value)
		}
	}
	keep(item.emit(add))
	return invalid
}

// unresolved is the refusal of a template that did not resolve. It is made
// only when needed: formatting it for every stream cost a ramp 5 % of the
// server's CPU, and grew the request goroutine's stack past 8 KiB.
func (t template) unresolved() *rejection {
	return &rejection{status: 403, code: "channel_unresolved", detail: fmt.Sprintf("template %q did not resolve", t.raw)}
}

// channelItem is one comma-separated item of a channel template as it is
// resolved: text, or text around a list placeholder's values.
type channelItem struct {
	before, after string
	values        []string // nil: no list
}

func (c *channelItem) text(s string) {
	if c.values == nil {
		c.before += s
	} else {
		c.after += s
	}
}

func (c *channelItem) list(raw, value string) *rejection {
	if c.values != nil {
		return &rejection{status: 400, code: "channel_invalid", detail: fmt.Sprintf("template %q: two placeholders of one channel are lists", raw)}
	}
	c.values = strings.Split(value, ",")
	for i, v := range c.values {
		if c.values[i] = strings.TrimSpace(v); c.values[i] == "" {
			return &rejection{status: 400, code: "channel_invalid", detail: fmt.Sprintf("template %q: an empty item in the list %q", raw, value)}
		}
	}
	return nil
}

func (c *channelItem) emit(add func(string) *rejection) *rejection {
	if c.values == nil {
		return add(c.before)
	}
	for _, v := range c.values {
		if rej := add(c.before + v + c.after); rej != nil {
			return rej
		}
	}
	return nil
}
