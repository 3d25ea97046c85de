// Package testwriter lets the test suites run with either writer: with
// SSE_TEST_WRITER set (net_http or takeover), every sse block of a test's
// Caddyfile gets `writer <mode>`.
package testwriter

import (
	"os"
	"regexp"
)

// sseBlock matches the opening line of an sse directive's block.
var sseBlock = regexp.MustCompile(`(?m)^(\s*)sse\b[^\n{]*\{[ \t]*$`)

// writerLine matches a writer line that Apply put in.
var writerLine = regexp.MustCompile(`(?m)^[ \t]*writer (net_http|takeover)[ \t]*\n`)

// Apply puts `writer <mode>` into every sse block of caddyfile when
// SSE_TEST_WRITER is set; applying it twice changes nothing more.
func Apply(caddyfile string) string {
	mode := os.Getenv("SSE_TEST_WRITER")
	if mode == "" {
		return caddyfile
	}
	caddyfile = writerLine.ReplaceAllString(caddyfile, "")
	return sseBlock.ReplaceAllString(caddyfile, "$0\n${1}\twriter "+mode)
}
