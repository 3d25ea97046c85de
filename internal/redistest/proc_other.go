//go:build !linux

package redistest

import "syscall"

// dieWithParent: only Linux can; elsewhere cleanup stops the servers.
func dieWithParent() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }
