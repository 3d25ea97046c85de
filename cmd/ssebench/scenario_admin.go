package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// startCPUProfile fetches the server's CPU profile over the next d into
// -server-cpuprofile, if set; wait blocks until it is written.
func (r *runner) startCPUProfile(d time.Duration) (wait func()) {
	if r.cfg.serverCPUProfile == "" {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		secs := int(math.Max(1, math.Round(d.Seconds())))
		err := r.adminToFile(fmt.Sprintf("/debug/pprof/profile?seconds=%d", secs), r.cfg.serverCPUProfile, d+60*time.Second)
		if err != nil {
			r.note("cpu profile: " + err.Error())
		}
	}()
	return func() { <-done }
}

// adminToFile GETs path from the admin endpoint into file.
func (r *runner) adminToFile(path, file string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+r.cfg.admin+path, nil)
	if err != nil {
		return err
	}
	resp, err := adminDo(r.cfg.admin, req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: status %d", path, resp.StatusCode)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// serverGoroutines reads the goroutine count from the admin's pprof index,
// summed over every -admin (0 without -admin).
func (r *runner) serverGoroutines() int {
	n := 0
	for _, a := range r.cfg.admins {
		n += adminGoroutines(a)
	}
	return n
}

func adminGoroutines(admin string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/pprof/goroutine?debug=1", nil)
	resp, err := adminDo(admin, req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	// goroutine profile: total 20012
	_, n, ok := strings.Cut(strings.TrimSpace(line), "total ")
	if !ok {
		return 0
	}
	v, _ := strconv.Atoi(n)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<20))
	return v
}

// serverMemStats reads runtime.MemStats from the admin's /debug/vars, summed
// over every -admin (nil if one does not answer).
func (r *runner) serverMemStats() *memStats {
	var sum *memStats
	for _, a := range r.cfg.admins {
		m := adminMemStats(a)
		if m == nil {
			return nil
		}
		if sum == nil {
			sum = m
			continue
		}
		sum.HeapAlloc += m.HeapAlloc
		sum.HeapInuse += m.HeapInuse
		sum.HeapIdle += m.HeapIdle
		sum.StackInuse += m.StackInuse
		sum.MSpanInuse += m.MSpanInuse
		sum.GCSys += m.GCSys
		sum.OtherSys += m.OtherSys
		sum.Sys += m.Sys
		sum.NumGC += m.NumGC
	}
	return sum
}

func adminMemStats(admin string) *memStats {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/debug/vars", nil)
	resp, err := adminDo(admin, req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var v struct {
		MemStats struct {
			HeapAlloc, HeapInuse, HeapIdle, HeapReleased, StackInuse, MSpanInuse, GCSys, OtherSys, Sys int64
			NumGC                                                                                      int64
		} `json:"memstats"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return nil
	}
	m := v.MemStats
	k := func(b int64) int64 { return b >> 10 }
	return &memStats{
		HeapAlloc: k(m.HeapAlloc), HeapInuse: k(m.HeapInuse), HeapIdle: k(m.HeapIdle - m.HeapReleased),
		StackInuse: k(m.StackInuse), MSpanInuse: k(m.MSpanInuse), GCSys: k(m.GCSys), OtherSys: k(m.OtherSys),
		Sys: k(m.Sys), NumGC: m.NumGC,
	}
}
