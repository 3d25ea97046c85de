package caddysse

import (
	"math"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The sharded histogram exposes what Prometheus' own histogram does for the
// same observations, written from many shards at once: same buckets,
// count and sum, whole-number observations scaled to the metric's unit
// (milliseconds to seconds), and a value on a bucket's bound inside it.
func TestShardedHistogramMatchesPrometheus(t *testing.T) {
	bounds := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	ours := newShardedHistogram("x_seconds", "x", bounds, 1000)
	theirs := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x_seconds", Help: "x", Buckets: bounds})
	values := []uint64{0, 1, 2, 3, 5, 9, 10, 11, 25, 99, 100, 2500, 9999, 10000, 10001, 123456}
	var wg sync.WaitGroup
	for shard := range metricShards + 3 { // more writers than shards: some share one
		wg.Go(func() {
			for _, v := range values {
				ours.observe(uint8(shard), v)
			}
		})
		for _, v := range values {
			theirs.Observe(float64(v) / 1000)
		}
	}
	wg.Wait()
	got, want := collectHistogram(t, ours), collectHistogram(t, theirs)
	// Prometheus adds float seconds one by one; the shards add whole
	// milliseconds, exactly
	if got.GetSampleCount() != want.GetSampleCount() || math.Abs(got.GetSampleSum()-want.GetSampleSum()) > 1e-9 {
		t.Fatalf("count, sum: got %d, %g; want %d, %g", got.GetSampleCount(), got.GetSampleSum(), want.GetSampleCount(), want.GetSampleSum())
	}
	if len(got.Bucket) != len(want.Bucket) {
		t.Fatalf("got %d buckets, want %d", len(got.Bucket), len(want.Bucket))
	}
	for i := range want.Bucket {
		g, w := got.Bucket[i], want.Bucket[i]
		if g.GetUpperBound() != w.GetUpperBound() || g.GetCumulativeCount() != w.GetCumulativeCount() {
			t.Errorf("bucket %d: got le=%g %d, want le=%g %d", i, g.GetUpperBound(), g.GetCumulativeCount(), w.GetUpperBound(), w.GetCumulativeCount())
		}
	}
}

// The queue-depth buckets (1, 2, 4 … 2048 events, unit 1) put a depth on a
// bound inside that bound's bucket.
func TestShardedHistogramWholeBounds(t *testing.T) {
	h := newShardedHistogram("q", "q", prometheus.ExponentialBuckets(1, 2, 12), 1)
	for _, v := range []uint64{1, 2, 3, 4, 2048, 2049} {
		h.observe(0, v)
	}
	m := collectHistogram(t, h)
	want := map[float64]uint64{1: 1, 2: 2, 4: 4, 2048: 5}
	for _, b := range m.Bucket {
		if n, ok := want[b.GetUpperBound()]; ok && b.GetCumulativeCount() != n {
			t.Errorf("le=%g: got %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), n)
		}
	}
	if m.GetSampleCount() != 6 || m.GetSampleSum() != 1+2+3+4+2048+2049 {
		t.Errorf("count %d sum %g", m.GetSampleCount(), m.GetSampleSum())
	}
}

func TestShardedCounterSumsShards(t *testing.T) {
	c := newShardedCounter("n_total", "n")
	var wg sync.WaitGroup
	for shard := range 40 {
		wg.Go(func() {
			for range 1000 {
				c.add(uint8(shard), 2)
			}
		})
	}
	wg.Wait()
	if got := collectOne(t, c).GetCounter().GetValue(); got != 80000 {
		t.Fatalf("got %g, want 80000", got)
	}
}

func collectHistogram(t *testing.T, c prometheus.Collector) *dto.Histogram {
	t.Helper()
	return collectOne(t, c).GetHistogram()
}

// collectOne is the one metric a collector reports.
func collectOne(t *testing.T, c prometheus.Collector) *dto.Metric {
	t.Helper()
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var m dto.Metric
	if err := (<-ch).Write(&m); err != nil {
		t.Fatal(err)
	}
	return &m
}

// Two goroutines delivering at once, as two event loops do: each writing
// its own shard against both writing Prometheus' own histogram.
func BenchmarkDeliveryMetrics(b *testing.B) {
	m := newMetrics()
	b.Run("sharded", func(b *testing.B) {
		var next sync.Mutex
		var n uint8
		b.SetParallelism(1)
		b.RunParallel(func(pb *testing.PB) {
			next.Lock()
			shard := loopShard(int(n))
			n++
			next.Unlock()
			for pb.Next() {
				m.queueDepth(shard, 1)
				m.latency(shard, 30)
				m.delivered(shard, 1)
			}
		})
	})
	b.Run("prometheus", func(b *testing.B) {
		depth := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "d", Buckets: prometheus.ExponentialBuckets(1, 2, 12)})
		latency := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "l", Buckets: prometheus.DefBuckets})
		delivered := prometheus.NewCounter(prometheus.CounterOpts{Name: "c"})
		b.SetParallelism(1)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				depth.Observe(1)
				latency.Observe(.03)
				delivered.Add(1)
			}
		})
	})
}
