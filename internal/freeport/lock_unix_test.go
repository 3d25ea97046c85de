//go:build unix

package freeport

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// A port this process was handed is not handed to another test binary
// while this one runs, and is free to others once it has ended: a child
// process (this test binary again) claims a port; this process cannot,
// then can once the child is gone.
func TestAPortClaimedByAnotherProcessIsNotHandedOut(t *testing.T) {
	if port := os.Getenv("FREEPORT_TEST_CLAIM"); port != "" {
		n, _ := strconv.Atoi(port)
		if !claim(n) {
			os.Exit(3)
		}
		os.Stdout.WriteString("claimed\n")
		_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it
		os.Exit(0)
	}
	const port = 70001 // an offset past every port: no other test claims it
	child := exec.Command(os.Args[0], "-test.run", "^TestAPortClaimedByAnotherProcessIsNotHandedOut$")
	child.Env = append(os.Environ(), "FREEPORT_TEST_CLAIM="+strconv.Itoa(port))
	stdin, _ := child.StdinPipe()
	stdout, _ := child.StdoutPipe()
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "claimed\n" {
		stdin.Close()
		_ = child.Wait()
		t.Fatalf("the child did not claim port %d: %q %v", port, line, err)
	}
	if claim(port) {
		t.Fatal("a port another process holds was claimed")
	}
	stdin.Close()
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !claim(port) {
		if time.Now().After(deadline) {
			t.Fatal("the port stayed held after its process ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
