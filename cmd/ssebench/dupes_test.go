package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"
)

// dupWriter writes every event frame twice (a server that duplicates).
type dupWriter struct{ http.ResponseWriter }

func (d dupWriter) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("\nid: ")) {
		if _, err := d.ResponseWriter.Write(p); err != nil {
			return 0, err
		}
	}
	return d.ResponseWriter.Write(p)
}
func (d dupWriter) Flush() { d.ResponseWriter.(http.Flusher).Flush() }

// A server that sends every event twice fails a fanout run, as it fails a
// reconnect storm: a load run that passes with duplicates says nothing.
func TestFanoutFailsOnDuplicates(t *testing.T) {
	hub := newFakeSSE()
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			w = dupWriter{w}
		}
		hub.ServeHTTP(w, r)
	}))
	args := append([]string{"fanout", "-engine", "std", "-conns", "20", "-rate", "20", "-duration", "1s"}, common(base)...)
	code, res, _ := runTool(t, args)
	t.Logf("exit %d ok=%v lost=%d dupes=%d", code, res.OK, res.Delivery.Lost, res.Delivery.Dupes)
	if res.Delivery.Dupes == 0 {
		t.Fatal("the fake did not duplicate")
	}
	if code == 0 || res.OK {
		t.Errorf("fanout with %d duplicated deliveries passed (exit %d, ok %v)", res.Delivery.Dupes, code, res.OK)
	}
}

// runTool runs the tool with args and returns its exit code, its JSON line
// and what it wrote to stderr.
func runTool(t *testing.T, args []string) (int, result, *bytes.Buffer) {
	t.Helper()
	cfg, err := parseArgs(args)
	if err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	code := newRunner(cfg, &stdout, &stderr).run()
	var res result
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		t.Fatalf("the JSON line does not parse: %v\n%s", err, stdout.String())
	}
	return code, res, &stderr
}
