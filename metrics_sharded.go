package caddysse

import (
	"math"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// The metrics written at every delivery (events delivered, delivery
// latency, queue depth) keep one copy per shard, each on cache lines of its
// own, summed when Prometheus collects them. An event loop writes its own
// shard, so two loops delivering on two cores at once do not pass the same
// cache lines back and forth: with Prometheus' own counter and histograms
// (one set of words every writer updates) that cost 0.3–0.4 µs per delivery
// in the fan-out benchmark, 7 % of the server's CPU (docs/PERFORMANCE.md).
const metricShards = 16

// cacheLinePair is two cache lines: x86 processors fetch lines in adjacent
// pairs, so a shard padded to one line would still share with its neighbour.
const cacheLinePair = 128

// shardedCounter is a Prometheus counter of whole numbers kept in shards.
type shardedCounter struct {
	desc   *prometheus.Desc
	shards [metricShards]struct {
		n atomic.Uint64
		_ [cacheLinePair - 8]byte
	}
}

func newShardedCounter(name, help string) *shardedCounter {
	return &shardedCounter{desc: prometheus.NewDesc(prometheus.BuildFQName("caddy", "sse", name), help, nil, nil)}
}

func (c *shardedCounter) add(shard uint8, n uint64) { c.shards[shard%metricShards].n.Add(n) }

func (c *shardedCounter) total() uint64 {
	var sum uint64
	for i := range c.shards {
		sum += c.shards[i].n.Load()
	}
	return sum
}

// Describe implements prometheus.Collector.
func (c *shardedCounter) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *shardedCounter) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(c.total()))
}

// histogramBuckets is the most buckets a shardedHistogram has, so that a
// shard (the count of each bucket, of +Inf, and the sum) fills two cache
// lines exactly.
const histogramBuckets = 14

// shardedHistogram is a Prometheus histogram of whole-number observations
// (milliseconds, events) kept in shards. Its buckets' bounds are in the
// metric's unit, observations in 1/perUnit of it (perUnit 1000 records
// milliseconds into a histogram of seconds).
type shardedHistogram struct {
	desc    *prometheus.Desc
	bounds  []float64
	limits  []uint64 // the largest observation each bucket takes
	perUnit float64
	shards  [metricShards]histogramShard
}

type histogramShard struct {
	counts [histogramBuckets + 1]atomic.Uint64 // per bucket, not cumulative; the last is +Inf
	sum    atomic.Uint64
}

func newShardedHistogram(name, help string, bounds []float64, perUnit float64) *shardedHistogram {
	if len(bounds) > histogramBuckets {
		panic("shardedHistogram: too many buckets") // a programming error: the buckets are constants
	}
	h := &shardedHistogram{
		desc:   prometheus.NewDesc(prometheus.BuildFQName("caddy", "sse", name), help, nil, nil),
		bounds: bounds, perUnit: perUnit,
	}
	for _, b := range bounds {
		// a bucket takes what is ≤ its bound: a whole-number observation
		// v is in it if v ≤ floor(bound·perUnit), the rounding guarding
		// bounds such as 0.001·1000 that floating point puts a hair below 1
		h.limits = append(h.limits, uint64(math.Floor(b*perUnit+1e-9)))
	}
	return h
}

// observe records v in the shard's copy.
func (h *shardedHistogram) observe(shard uint8, v uint64) {
	sh := &h.shards[shard%metricShards]
	i := 0
	for i < len(h.limits) && v > h.limits[i] {
		i++
	}
	sh.counts[i].Add(1)
	sh.sum.Add(v)
}

// Describe implements prometheus.Collector.
func (h *shardedHistogram) Describe(ch chan<- *prometheus.Desc) { ch <- h.desc }

// Collect implements prometheus.Collector. The shards are read one by one
// while writers go on, so the sum may include an observation the buckets
// do not yet; the count is the buckets' total, as Prometheus requires.
func (h *shardedHistogram) Collect(ch chan<- prometheus.Metric) {
	var counts [histogramBuckets + 1]uint64
	var sum uint64
	for s := range h.shards {
		for i := range counts {
			counts[i] += h.shards[s].counts[i].Load()
		}
		sum += h.shards[s].sum.Load()
	}
	cumulative := make(map[float64]uint64, len(h.bounds))
	var count uint64
	for i, b := range h.bounds {
		count += counts[i]
		cumulative[b] = count
	}
	count += counts[len(h.bounds)]
	ch <- prometheus.MustNewConstHistogram(h.desc, count, float64(sum)/h.perUnit, cumulative)
}

var (
	_ prometheus.Collector = (*shardedCounter)(nil)
	_ prometheus.Collector = (*shardedHistogram)(nil)
)
