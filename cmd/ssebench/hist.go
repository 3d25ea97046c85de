package main

import (
	"encoding/json"
	"fmt"
	"math"
	"math/bits"
)

// histogram is a log-linear histogram of non-negative values (nanoseconds
// here): values below 256 are exact, larger ones fall in buckets of 128 per
// power of two, so a percentile is off by less than 1/128 (0.8 %) of the
// value. It costs a fixed ~60 KiB and records in a few nanoseconds without
// allocating; histograms merge by adding counts.
type histogram struct {
	counts [histBuckets]uint64
	n      uint64
	sum    float64
	min    int64
	max    int64
}

const (
	histSubBits = 7
	histSub     = 1 << histSubBits        // 128 buckets per power of two
	histLinear  = 2 * histSub             // values below this are exact
	histBuckets = histLinear + 56*histSub // up to 2^63
)

func histIndex(v int64) int {
	if v < histLinear {
		if v < 0 {
			return 0
		}
		return int(v)
	}
	s := bits.Len64(uint64(v)) - (histSubBits + 1) // ≥ 1
	top := v >> s                                  // in [128, 256)
	return histLinear + (s-1)*histSub + int(top-histSub)
}

// histBounds returns the smallest and largest value of bucket i.
func histBounds(i int) (lo, hi int64) {
	if i < histLinear {
		return int64(i), int64(i)
	}
	s := (i-histLinear)/histSub + 1
	top := int64((i-histLinear)%histSub + histSub)
	lo = top << s
	hi = (top+1)<<s - 1
	return lo, hi
}

func (h *histogram) Record(v int64) {
	if v < 0 {
		v = 0
	}
	h.counts[histIndex(v)]++
	if h.n == 0 || v < h.min {
		h.min = v
	}
	if v > h.max {
		h.max = v
	}
	h.n++
	h.sum += float64(v)
}

func (h *histogram) Merge(o *histogram) {
	if o.n == 0 {
		return
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.n == 0 || o.min < h.min {
		h.min = o.min
	}
	if o.max > h.max {
		h.max = o.max
	}
	h.n += o.n
	h.sum += o.sum
}

func (h *histogram) Count() uint64 { return h.n }

func (h *histogram) Max() int64 { return h.max }

func (h *histogram) Mean() float64 {
	if h.n == 0 {
		return 0
	}
	return h.sum / float64(h.n)
}

// Quantile returns the value at quantile q in [0, 1]: the midpoint of the
// bucket holding the ceil(q·n)-th smallest value, clamped to the recorded
// minimum and maximum. It is 0 for an empty histogram.
func (h *histogram) Quantile(q float64) int64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	if rank < 1 {
		rank = 1
	}
	if rank > h.n {
		rank = h.n
	}
	var cum uint64
	for i, c := range h.counts {
		cum += c
		if cum >= rank {
			lo, hi := histBounds(i)
			v := lo + (hi-lo)/2
			return min(max(v, h.min), h.max)
		}
	}
	return h.max
}

// latencySummary is a histogram's percentiles in milliseconds.
type latencySummary struct {
	N      uint64  `json:"n"`
	P50ms  float64 `json:"p50_ms"`
	P90ms  float64 `json:"p90_ms"`
	P99ms  float64 `json:"p99_ms"`
	P999ms float64 `json:"p999_ms"`
	MaxMs  float64 `json:"max_ms"`
	MeanMs float64 `json:"mean_ms"`
}

func (h *histogram) Summary() *latencySummary {
	ms := func(ns int64) float64 { return math.Round(float64(ns)/1e3) / 1e3 }
	return &latencySummary{
		N:      h.n,
		P50ms:  ms(h.Quantile(0.50)),
		P90ms:  ms(h.Quantile(0.90)),
		P99ms:  ms(h.Quantile(0.99)),
		P999ms: ms(h.Quantile(0.999)),
		MaxMs:  ms(h.max),
		MeanMs: ms(int64(h.Mean())),
	}
}

// histWire is a histogram on the wire (a subscriber worker's report to the
// parent): the non-empty buckets as [index, count] pairs, so that the
// parent merges exactly what the worker recorded.
type histWire struct {
	N       uint64      `json:"n"`
	Sum     float64     `json:"sum"`
	Min     int64       `json:"min"`
	Max     int64       `json:"max"`
	Buckets [][2]uint64 `json:"b,omitempty"`
}

func (h *histogram) MarshalJSON() ([]byte, error) {
	w := histWire{N: h.n, Sum: h.sum, Min: h.min, Max: h.max}
	for i, c := range h.counts {
		if c != 0 {
			w.Buckets = append(w.Buckets, [2]uint64{uint64(i), c})
		}
	}
	return json.Marshal(w)
}

func (h *histogram) UnmarshalJSON(b []byte) error {
	var w histWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*h = histogram{n: w.N, sum: w.Sum, min: w.Min, max: w.Max}
	var total uint64
	for _, bc := range w.Buckets {
		if bc[0] >= histBuckets {
			return fmt.Errorf("histogram: bucket %d out of range", bc[0])
		}
		h.counts[bc[0]] += bc[1]
		total += bc[1]
	}
	if total != w.N {
		return fmt.Errorf("histogram: buckets hold %d values, n is %d", total, w.N)
	}
	return nil
}
