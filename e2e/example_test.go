package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// The multi-instance example works as documented: its script exits 0
// (it checks delivery and resume itself) on free ports.
func TestMultiInstanceExample(t *testing.T) {
	redistest.Require(t)
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "examples", "multi-instance", "run.sh"))
	cmd.Env = append(os.Environ(),
		fmt.Sprint("REDIS_PORT=", redistest.FreePort(t)),
		fmt.Sprint("A_PORT=", freePort(t, false)), fmt.Sprint("B_PORT=", freePort(t, false)),
		fmt.Sprint("A_ADMIN=", freePort(t, false)), fmt.Sprint("B_ADMIN=", freePort(t, false)))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK: cross-instance delivery and resume work") {
		t.Fatalf("examples/multi-instance/run.sh: %v\n%s", err, out)
	}
}
