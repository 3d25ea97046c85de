package redistest

import "syscall"

// dieWithParent makes a server die with the test process, even if the
// test is killed before its cleanup runs.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
