package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// A server may be several processes: nginx's master and its workers
// (Nchan), Pushpin's runner and the services it starts. The figures of a
// server are those of its whole process tree, so that such servers are
// measured like a single Caddy process.

// readProcTree reads pid and every process descended from it, and sums
// them. With more than one process the RSS is the sum of their
// proportional set sizes (Pss, /proc/<pid>/smaps_rollup), so that the
// pages they share (code, a shared memory zone) count once, not once per
// process; a lone process keeps its plain RSS.
func readProcTree(pid int) (procSample, error) {
	kids := descendants(pid)
	if len(kids) == 0 {
		return readProc(pid)
	}
	sum, err := readProcPss(pid)
	if err != nil {
		return sum, err
	}
	for _, kid := range kids {
		s, err := readProcPss(kid)
		if err != nil {
			continue // it ended meanwhile
		}
		sum.rssKiB += s.rssKiB
		sum.hwmKiB += s.hwmKiB
		sum.cpuSec += s.cpuSec
		sum.userSec += s.userSec
		sum.threads += s.threads
		sum.fds += s.fds
	}
	return sum, nil
}

// readProcPss is readProc with the RSS replaced by the Pss.
func readProcPss(pid int) (procSample, error) {
	s, err := readProc(pid)
	if err != nil {
		return s, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return s, err
	}
	pss, err := parsePss(b)
	if err != nil {
		return s, err
	}
	s.rssKiB = pss
	return s, nil
}

// parsePss reads the Pss line of /proc/<pid>/smaps_rollup.
func parsePss(b []byte) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if ok && name == "Pss" {
			return parseKB(strings.TrimSpace(value))
		}
	}
	return 0, errors.New("smaps_rollup: no Pss")
}

// descendants returns the processes descended from pid, from the parent
// pids in /proc/<pid>/stat.
func descendants(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil || p == pid {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if ppid, ok := parsePPID(b); ok {
			children[ppid] = append(children[ppid], p)
		}
	}
	var out []int
	queue := []int{pid}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, kid := range children[p] {
			out = append(out, kid)
			queue = append(queue, kid)
		}
	}
	return out
}

// parsePPID reads the parent pid (field 4) of /proc/<pid>/stat; the name
// before it is in parentheses and may hold anything.
func parsePPID(b []byte) (int, bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, false
	}
	ppid, err := strconv.Atoi(f[1])
	return ppid, err == nil
}
