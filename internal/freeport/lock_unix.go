//go:build unix

package freeport

import (
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

// The test binaries of the packages run side by side (go test ./..., and
// make test's lanes), each handing out ports of the same range. A port a
// test let go of (a Redis it killed to test a fault) was free to another
// binary, which could start its own server there while something of the
// first test still dialed the old address: two tests' servers mistaken for
// each other. So a port handed out stays this process's for its life: a
// one-byte POSIX record lock at offset port of one shared file, which the
// kernel releases when the process ends, however it ends.

var (
	lockOnce sync.Once
	lockFile *os.File // nil if the file could not be opened: no locking
)

// claim reports whether port is now this process's (or cannot be told:
// no lock file), false if another process holds it.
func claim(port int) bool {
	lockOnce.Do(func() {
		f, err := os.OpenFile(filepath.Join(os.TempDir(), "caddy-sse-freeport.lock"), os.O_RDWR|os.O_CREATE, 0o666)
		if err == nil {
			lockFile = f
		}
	})
	if lockFile == nil {
		return true
	}
	lk := syscall.Flock_t{Type: syscall.F_WRLCK, Whence: 0, Start: int64(port), Len: 1}
	return syscall.FcntlFlock(lockFile.Fd(), syscall.F_SETLK, &lk) == nil
}
