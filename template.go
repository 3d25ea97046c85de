package caddysse

import (
	"net/http"
	"net/textproto"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// template is a channel or principal template, compiled when the config
// loads. The common ones — literal text with query and header placeholders,
// like "user:{http.request.header.X-User}" or "{http.request.uri.query.channels}"
// — are resolved directly from the request, the way Caddy's replacer resolves
// those placeholders (several values joined with ","). Going through the
// replacer costs a stream's start far more: its placeholder function is large
// enough to grow the request goroutine's stack. Any other template uses the
// replacer.
type template struct {
	raw   string
	parts []templatePart // nil: use the replacer
}

type templatePart struct {
	kind  partKind
	value string // the literal text, query key or canonical header field
}

type partKind uint8

const (
	partLiteral partKind = iota
	partQuery
	partHeader
)

const (
	queryPrefix  = "http.request.uri.query."
	headerPrefix = "http.request.header."
)

func compileTemplate(raw string) template {
	t := template{raw: raw}
	if strings.Contains(raw, `\`) {
		return t // escaped braces: leave them to the replacer
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
		default:
			return t // any other placeholder (or a default value): the replacer
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
		var v string
		switch p.kind {
		case partLiteral:
			b.WriteString(p.value)
			continue
		case partQuery:
			v = queryValues(r.URL, p.value)
		case partHeader:
			v = strings.Join(r.Header[p.value], ",")
		}
		if v == "" {
			return "", false
		}
		b.WriteString(v)
	}
	return b.String(), true
}
