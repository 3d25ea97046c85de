package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// caddy validate provisions and cleans up the config without running it:
// it must succeed for a good config without binding the site's port, and
// name the file and line of a Caddyfile mistake.
func TestValidateCommand(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t, false)
	good := filepath.Join(dir, "Caddyfile")
	writeFile(t, good, fmt.Sprintf(`{
	admin off
	persist_config off
}
:%d {
	sse /events {
		channel {query.channels}
		publish {
			secret validate-secret
		}
	}
}
`, port))
	if out, err := validate(t, dir, good); err != nil {
		t.Fatalf("validate of a good config: %v\n%s", err, out)
	}
	// validating bound nothing: the site's port is still free
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatalf("validate left port %d in use: %v", port, err)
	}
	ln.Close()

	bad := filepath.Join(dir, "Caddyfile.bad")
	writeFile(t, bad, ":1234 {\n\tsse {\n\t\tchannel a\n\t\tbogus\n\t}\n}\n")
	out, err := validate(t, dir, bad)
	if err == nil || !strings.Contains(out, "Caddyfile.bad:4") || !strings.Contains(out, "unrecognized sse subdirective") {
		t.Fatalf("validate of a bad config: err %v, output does not name Caddyfile.bad:4:\n%s", err, out)
	}
}

func validate(t *testing.T, dir, file string) (string, error) {
	t.Helper()
	cmd := exec.Command(caddyBin, "validate", "--config", file, "--adapter", "caddyfile")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("caddy validate did not return")
	}
	return string(out), err
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
