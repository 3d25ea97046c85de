// Package freeport picks listening ports for tests (Get) and for the
// servers the load tool spawns (Take). Ports are drawn at
// random below the kernel's ephemeral range: the ephemeral ports are also
// what every outgoing connection (and every listen on port 0) takes, so a
// port found free there is easily taken before the test binds it when
// other test packages run in parallel.
package freeport

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

var (
	mu    sync.Mutex
	given = map[int]bool{}
)

// Avoid lists ports never handed out: well-known ports of things a
// developer runs (Caddy's admin, Redis, ...).
var avoid = map[int]bool{2019: true, 6379: true, 8080: true, 8443: true, 26379: true}

// Get returns a port free on every interface (TCP, and UDP too if udp is
// set) that no other caller in this process got, nor (on unix) another
// test binary running beside it (claim). Cluster nodes use port+10000 for
// their bus, so that one is checked free and claimed as well.
func Get(t TB, udp bool) int {
	t.Helper()
	port, err := Take(udp)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// TB is the part of testing.TB that Get uses: the package does not import
// testing, so that the load tool (Take) does not link it.
type TB interface {
	Helper()
	Fatal(args ...any)
}

// Take is Get for code that runs outside a test's goroutine (the load
// tool's spawned servers, which its tests run in-process): an error
// instead of a failed test.
func Take(udp bool) (int, error) {
	lo, hi := 20000, ephemeralStart()-1
	if hi-lo < 1000 {
		lo, hi = 10000, 20000
	}
	mu.Lock()
	defer mu.Unlock()
	for range 1000 {
		port := lo + rand.IntN(hi-lo)
		bus := port + 10000
		if given[port] || avoid[port] || !free(port, udp) || (bus <= 65535 && !free(bus, false)) {
			continue
		}
		if !claim(port) || (bus <= 65535 && !claim(bus)) {
			continue // another test binary's (lock_unix.go)
		}
		given[port] = true
		return port, nil
	}
	return 0, errors.New("freeport: no free port")
}

func free(port int, udp bool) bool {
	ln, err := net.Listen("tcp", ":"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	ln.Close()
	if udp {
		pc, err := net.ListenPacket("udp", ":"+strconv.Itoa(port))
		if err != nil {
			return false
		}
		pc.Close()
	}
	return true
}

// ephemeralStart reads the first port of the kernel's ephemeral range.
func ephemeralStart() int {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	fields := strings.Fields(string(data))
	if len(fields) < 1 {
		return 32768
	}
	n, err := strconv.Atoi(fields[0])
	if err != nil {
		return 32768
	}
	return n
}
