package caddysse

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestMain keeps the in-process Caddy from writing to the user's
// directories: its autosaved config and its storage go to a temporary
// directory.
func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "caddy-sse-test-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	caddy.ConfigAutosavePath = filepath.Join(dir, "autosave.json")
	caddy.DefaultStorage.Path = filepath.Join(dir, "data")
	return m.Run()
}
