package caddysse

import (
	"fmt"
	"net/http"
	"net/textproto"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// template is a channel or principal template, compiled when the config
// loads into literal text and placeholders. The common placeholders — query
// and header values, like "user:{http.request.header.X-User}" or
// "{http.request.uri.query.channels}" — are resolved directly from the
// request, the way Caddy's replacer resolves them (several values joined
// with ","). Going through the replacer costs a stream's start far more:
// its placeholder function is large enough to grow the request goroutine's
// stack. Any other placeholder goes to the replacer on its own, and a
// template with escaped or nested braces to the replacer as a whole.
type template struct {
	raw   string
	parts []templatePart // nil: the whole template goes to the replacer
}

type templatePart struct {
	kind partKind
	// the literal text, query key, canonical header field, or (for the
	// replacer) the whole placeholder with its braces
	value string
}

type partKind uint8

const (
	partLiteral partKind = iota
	partQuery
	partHeader
	partReplacer
)

const (
	queryPrefix  = "http.request.uri.query."
	headerPrefix = "http.request.header."
)

func compileTemplate(raw string) template {
	t := template{raw: raw}
	if strings.Contains(raw, `\{`) || strings.Contains(raw, `\}`) {
		// escaped braces: leave them to the replacer. Only a backslash
		// before a brace escapes (elsewhere the replacer keeps it as
		// text): a template such as `tenant\a:{query.topics}` is compiled,
		// so that its text stays around each item of a list
		return t
	}
	var parts []templatePart
	rest := raw
	for rest != "" {
		open := strings.IndexByte(rest, '{')
		if open < 0 {
			if strings.IndexByte(rest, '}') >= 0 {
				return t
			}
			parts = append(parts, templatePart{kind: partLiteral, value: rest})
			break
		}
		if strings.IndexByte(rest[:open], '}') >= 0 {
			return t
		}
		if open > 0 {
			parts = append(parts, templatePart{kind: partLiteral, value: rest[:open]})
		}
		end := strings.IndexByte(rest[open:], '}')
		if end < 0 {
			return t
		}
		name := rest[open+1 : open+end]
		switch {
		case strings.HasPrefix(name, queryPrefix) && len(name) > len(queryPrefix) && !strings.ContainsAny(name, "{:"):
			parts = append(parts, templatePart{kind: partQuery, value: name[len(queryPrefix):]})
		case strings.HasPrefix(name, headerPrefix) && len(name) > len(headerPrefix) && !strings.ContainsAny(name, "{:"):
			parts = append(parts, templatePart{kind: partHeader, value: textproto.CanonicalMIMEHeaderKey(name[len(headerPrefix):])})
		case strings.ContainsAny(name, "{"):
			return t // nested braces: the replacer, on the whole template
		default: // any other placeholder (or one with a default value)
			parts = append(parts, templatePart{kind: partReplacer, value: rest[open : open+end+1]})
		}
		rest = rest[open+end+1:]
	}
	t.parts = parts
	return t
}

// resolve returns the template's value for a request; ok is false if a
// placeholder is unknown or empty (as the replacer's ReplaceOrErr with
// errOnEmpty and errOnUnknown).
func (t template) resolve(r *http.Request, repl *caddy.Replacer) (string, bool) {
	if t.parts == nil {
		v, err := repl.ReplaceOrErr(t.raw, true, true)
		return v, err == nil
	}
	if len(t.parts) == 1 && t.parts[0].kind == partLiteral {
		return t.parts[0].value, true
	}
	var b strings.Builder
	for _, p := range t.parts {
		v, ok := p.resolve(r, repl)
		if !ok {
			return "", false
		}
		b.WriteString(v)
	}
	return b.String(), true
}

// name is the placeholder as a template writes it in full.
func (p templatePart) name() string {
	switch p.kind {
	case partQuery:
		return "{" + queryPrefix + p.value + "}"
	case partHeader:
		return "{" + headerPrefix + p.value + "}"
	}
	return p.value
}

// resolve returns the part's value; ok is false for an unknown or empty
// placeholder.
func (p templatePart) resolve(r *http.Request, repl *caddy.Replacer) (string, bool) {
	var v string
	switch p.kind {
	case partLiteral:
		return p.value, true
	case partQuery:
		v = queryValues(r.URL, p.value)
	case partHeader:
		v = strings.Join(r.Header[p.value], ",")
	case partReplacer:
		var err error
		if v, err = repl.ReplaceOrErr(p.value, true, true); err != nil {
			return "", false
		}
	}
	return v, v != ""
}

// checkChannelTemplate refuses a channel template with a brace that does
// not open or close a placeholder ("user:{query.id", a typo, or an escaped
// brace): no channel name may hold one (SPEC S1), so the config would load
// and refuse every stream with 400 channel_invalid.
//
// It also refuses a channel of the template's own text, with no
// placeholder, that is no valid channel name ("news," names an empty one):
// it would be the same for every request, and refuse every stream.
func checkChannelTemplate(tmpl string) error {
	if !placeholderBraces(tmpl) {
		return fmt.Errorf("channel %q: every brace must open or close a placeholder (a channel name cannot hold one)", tmpl)
	}
	for _, item := range constantItems(tmpl) {
		if err := validateChannelName(strings.TrimSpace(item)); err != nil {
			return fmt.Errorf("channel %q: %v (commas in a template separate channels)", tmpl, err)
		}
	}
	return nil
}

// constantItems returns the comma-separated items of a channel template
// (whose braces placeholderBraces accepts) that hold no placeholder: the
// channels it names the same for every request.
func constantItems(tmpl string) []string {
	var items []string
	start, placeholders, inside := 0, 0, false
	for i := 0; i <= len(tmpl); i++ {
		switch {
		case i == len(tmpl) || (tmpl[i] == ',' && !inside):
			if placeholders == 0 {
				items = append(items, tmpl[start:i])
			}
			start, placeholders = i+1, 0
		case tmpl[i] == '{':
			inside = true
			placeholders++
		case tmpl[i] == '}':
			inside = false
		}
	}
	return items
}

// checkPrincipalTemplate refuses a principal template with a brace that
// does not open or close a placeholder: "{query.user" (a typo) resolved to
// itself for every request, so every client was one principal, sharing one
// cap and one throttle.
func checkPrincipalTemplate(tmpl string) error {
	if !placeholderBraces(tmpl) {
		return fmt.Errorf("principal %q: every brace must open or close a placeholder (a typo would make every client one principal)", tmpl)
	}
	return nil
}

// placeholderBraces reports whether every brace of s opens or closes a
// placeholder, none empty, nested or escaped.
func placeholderBraces(s string) bool {
	if strings.Contains(s, `\{`) || strings.Contains(s, `\}`) {
		return false
	}
	open := -1 // where the placeholder being read began
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '{' && open < 0:
			open = i
		case s[i] == '}' && open >= 0 && i > open+1:
			open = -1
		case s[i] == '{' || s[i] == '}':
			return false
		}
	}
	return open < 0
}
