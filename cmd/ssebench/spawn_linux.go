//go:build linux

package main

import "syscall"

// spawnAttrs makes the spawned server die with this tool (SIGKILL when the
// tool exits), so that no server is left running even if the tool is
// killed.
func spawnAttrs() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
