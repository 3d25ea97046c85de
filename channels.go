package caddysse

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
)

// MaxChannelNameLen bounds a channel name (SPEC S1).
const MaxChannelNameLen = 200

// validateChannelName checks a channel name: 1 to 200 bytes of UTF-8, no
// control characters, and none of "{", "}" (they delimit Redis hash tags)
// or "," (it separates the channels of a template).
func validateChannelName(name string) error {
	switch {
	case name == "":
		return errors.New("empty channel name")
	case len(name) > MaxChannelNameLen:
		return fmt.Errorf("channel name longer than %d bytes", MaxChannelNameLen)
	case !utf8.ValidString(name):
		return errors.New("channel name is not valid UTF-8")
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
	for _, tmpl := range h.channelTemplates {
		value, ok := tmpl.resolve(r, repl)
		if !ok || strings.TrimSpace(value) == "" {
			return nil, &rejection{status: 403, code: "channel_unresolved", detail: fmt.Sprintf("template %q did not resolve", tmpl.raw)}
		}
		for _, name := range strings.Split(value, ",") {
			name = strings.TrimSpace(name)
			if err := validateChannelName(name); err != nil {
				return nil, &rejection{status: 400, code: "channel_invalid", detail: err.Error()}
			}
			if _, dup := seen[name]; dup {
				continue
			}
			seen[name] = struct{}{}
			names = append(names, name)
		}
	}
	if len(names) > h.MaxChannels {
		return nil, &rejection{status: 400, code: "too_many_channels", detail: fmt.Sprintf("%d channels, at most %d", len(names), h.MaxChannels)}
	}
	return names, nil
}
