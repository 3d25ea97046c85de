package caddysse

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// metricsPool holds the module's collectors: one set while any config has
// an sse handler, so that counters run on across reloads (the new config's
// handlers take the set before the old ones let go). Each config load
// brings a new Prometheus registry, in which every Provision registers the
// same collectors again. A config with no sse handler lets the set go, and
// the next one starts from zero, as after a restart (Prometheus' rate()
// reads that as a counter reset).
var metricsPool = caddy.NewUsagePool()

const metricsKey = "caddy_sse"

// metrics are the module's Prometheus collectors (names caddy_sse_*). No
// label names a channel or a principal: their number has no bound.
type metrics struct {
	streamsOpen     prometheus.Gauge
	streamsOpened   prometheus.Counter
	rejections      *prometheus.CounterVec
	published       prometheus.Counter
	deliveredEvents *shardedCounter
	droppedEvents   prometheus.Counter
	catchUps        prometheus.Counter
	replays         prometheus.Counter
	truncated       prometheus.Counter
	replayedEvents  prometheus.Counter
	slowClients     prometheus.Counter
	latencySeconds  *shardedHistogram
	queueDepths     *shardedHistogram
	backend         *backendCollector
	// nextShard hands shards of the per-delivery metrics to streams that
	// have no event loop, round robin.
	nextShard atomic.Uint32
}

// watchedRefusals are the reasons a stream is refused, and a publish's
// failure (its backend down), counted from zero so that dashboards and
// alerts see them before the first one happens.
var watchedRefusals = []string{
	"principal_unresolved", "channel_unresolved", "channel_invalid", "too_many_channels",
	"throttled", "too_many_connections", "server_full", "publish_failed",
}

func newMetrics() *metrics {
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "caddy", Subsystem: "sse", Name: name, Help: help})
	}
	m := &metrics{
		streamsOpen: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "caddy", Subsystem: "sse", Name: "streams_open",
			Help: "Streams open now."}),
		streamsOpened: counter("streams_opened_total", "Streams opened."),
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "caddy", Subsystem: "sse", Name: "rejections_total",
			Help: "Requests refused, by reason (the error code of the refusal)."}, []string{"reason"}),
		published:       counter("events_published_total", "Events published through this instance's publish endpoints, one per channel."),
		deliveredEvents: newShardedCounter("events_delivered_total", "Events written to streams: live, replayed and caught up."),
		droppedEvents:   counter("events_dropped_total", "Live events that a full stream queue did not take; the stream catches up on them from the history."),
		catchUps:        counter("catchups_total", "Times a stream whose queue overflowed caught up from the history."),
		replays:         counter("replays_total", "Streams that opened with a Last-Event-ID."),
		truncated:       counter("replays_truncated_total", "Streams whose replay was truncated."),
		replayedEvents:  counter("events_replayed_total", "Events written in the replays of streams that opened with a Last-Event-ID."),
		slowClients:     counter("slow_client_disconnects_total", "Streams ended because the client read too slowly."),
		latencySeconds: newShardedHistogram("delivery_latency_seconds",
			"Time from the publish of a live event until its stream takes it from its queue to write it.",
			[]float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}, 1000),
		queueDepths: newShardedHistogram("queue_depth",
			"Events waiting in a stream's queue each time its writer takes them; never more than the queue setting.",
			prometheus.ExponentialBuckets(1, 2, 12), 1),
		backend: newBackendCollector(),
	}
	for _, reason := range watchedRefusals {
		m.rejections.WithLabelValues(reason)
	}
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{
		m.streamsOpen, m.streamsOpened, m.rejections, m.published, m.deliveredEvents, m.droppedEvents,
		m.catchUps, m.replays, m.truncated, m.replayedEvents, m.slowClients, m.latencySeconds,
		m.queueDepths, m.backend,
	}
}

// Destruct lets the pool drop the collectors once no handler uses them.
func (m *metrics) Destruct() error { return nil }

// acquireMetrics returns the process's collectors, registered in reg (the
// registry of the config being loaded). A collector registered already,
// by another handler of the same config, is no error.
func acquireMetrics(reg *prometheus.Registry) (*metrics, error) {
	val, _, err := metricsPool.LoadOrNew(metricsKey, func() (caddy.Destructor, error) { return newMetrics(), nil })
	if err != nil {
		return nil, err
	}
	m := val.(*metrics)
	if reg == nil {
		return m, nil
	}
	for _, c := range m.collectors() {
		var dup prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !(errors.As(err, &dup) && dup.ExistingCollector == c) {
			releaseMetrics()
			return nil, fmt.Errorf("registering metrics: %v", err)
		}
	}
	return m, nil
}

func releaseMetrics() {
	_, _ = metricsPool.Delete(metricsKey)
}

// The recording methods do nothing on a nil *metrics (a handler that was
// not provisioned, as in benchmarks).

func (m *metrics) streamOpened() {
	if m != nil {
		m.streamsOpen.Inc()
		m.streamsOpened.Inc()
	}
}

func (m *metrics) streamClosed() {
	if m != nil {
		m.streamsOpen.Dec()
	}
}

func (m *metrics) rejection(code string) {
	if m != nil {
		m.rejections.WithLabelValues(code).Inc()
	}
}

func (m *metrics) publishedEvent() {
	if m != nil {
		m.published.Inc()
	}
}

// goroutineShard is the shard for a stream that writes on goroutines (not
// an event loop's): one of the upper half, round robin; the loops have the
// lower half (loopShard).
func (m *metrics) goroutineShard() uint8 {
	if m == nil {
		return 0
	}
	return uint8(metricShards/2 + m.nextShard.Add(1)%(metricShards/2))
}

// loopShard is the shard of the i-th event loop.
func loopShard(i int) uint8 { return uint8(i % (metricShards / 2)) }

// delivered, latency and queueDepth run at every delivery: they write the
// caller's shard (metrics_sharded.go).
func (m *metrics) delivered(shard uint8, n int64) {
	if m != nil && n > 0 {
		m.deliveredEvents.add(shard, uint64(n))
	}
}

func (m *metrics) dropped(n int64) {
	if m != nil && n > 0 {
		m.droppedEvents.Add(float64(n))
	}
}

func (m *metrics) catchUp() {
	if m != nil {
		m.catchUps.Inc()
	}
}

// replay counts a stream that opened with a cursor, and whether its replay
// was truncated.
func (m *metrics) replay(withCursor, truncated bool) {
	if m == nil || !withCursor {
		return
	}
	m.replays.Inc()
	if truncated {
		m.truncated.Inc()
	}
}

// replayTruncated counts as truncated the replay, counted already, of a
// stream that started some of its channels later (they waited for Redis to
// accept their subscription) and found one of those truncated.
func (m *metrics) replayTruncated() {
	if m != nil {
		m.truncated.Inc()
	}
}

func (m *metrics) replayed(events int) {
	if m != nil && events > 0 {
		m.replayedEvents.Add(float64(events))
	}
}

func (m *metrics) slowClient() {
	if m != nil {
		m.slowClients.Inc()
	}
}

// latency records a live event's delay from publish to write, in ms (the
// resolution of an event's publish time). Clocks of other instances may be
// a little ahead: a negative delay counts as zero.
func (m *metrics) latency(shard uint8, ms int64) {
	if m != nil {
		m.latencySeconds.observe(shard, uint64(max(ms, 0)))
	}
}

func (m *metrics) queueDepth(shard uint8, events int) {
	if m != nil {
		m.queueDepths.observe(shard, uint64(max(events, 0)))
	}
}

// backendCollector reports the connection to a shared backend (Redis) of
// every hub whose broker implements pubsub.BackendReporter. It reports
// nothing while no hub has such a broker (the embedded hub).
type backendCollector struct {
	up, reconnects, channels, denied, reads, readsSent *prometheus.Desc

	mu sync.Mutex // two registries may collect at once (a reload): one at a time
	// the counters of the hubs run on across a reload with other Redis
	// settings, which replaces a hub, instead of falling back to the new
	// hub's counts
	reconnectsRun, readsRun, readsSentRun runningCount
}

func newBackendCollector() *backendCollector {
	return &backendCollector{
		up: prometheus.NewDesc("caddy_sse_redis_up",
			"1 if every Redis backend in use is reachable, else 0.", nil, nil),
		reconnects: prometheus.NewDesc("caddy_sse_redis_reconnects_total",
			"Connections to Redis backends made again after one was lost (one per outage, however many attempts it took).", nil, nil),
		channels: prometheus.NewDesc("caddy_sse_redis_channels_subscribed",
			"Channels subscribed to on Redis backends.", nil, nil),
		denied: prometheus.NewDesc("caddy_sse_redis_channels_denied",
			"Channels whose subscription Redis refuses this instance's user (ACL: SSUBSCRIBE or the shard channels): their streams get no live events, and new ones open degraded.", nil, nil),
		reads: prometheus.NewDesc("caddy_sse_redis_history_reads_total",
			"Reads of channels' histories that streams asked of Redis backends (replays, catch-ups, recoveries).", nil, nil),
		readsSent: prometheus.NewDesc("caddy_sse_redis_history_reads_sent_total",
			"Of those, the reads sent to Redis: streams that ask for the same page at once share one read.", nil, nil),
	}
}

// Describe sends the descriptors of the backend metrics.
func (c *backendCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.up
	ch <- c.reconnects
	ch <- c.channels
	ch <- c.denied
	ch <- c.reads
	ch <- c.readsSent
}

// Collect sums the status of the hubs' backends.
func (c *backendCollector) Collect(ch chan<- prometheus.Metric) {
	found, up := false, true
	var channels, denied int
	reconnects, reads, sent := map[any]uint64{}, map[any]uint64{}, map[any]uint64{}
	c.mu.Lock()
	defer c.mu.Unlock()
	hubs.Range(func(key, val any) bool {
		hub, ok := val.(interface{ Broker() pubsub.Broker })
		if !ok {
			return true
		}
		rep, ok := hub.Broker().(pubsub.BackendReporter)
		if !ok {
			return true
		}
		st := rep.BackendStatus()
		found, up = true, up && st.Up
		reconnects[key], reads[key], sent[key] = st.Reconnects, st.HistoryReads, st.HistoryReadsSent
		channels += st.Channels
		denied += st.Denied
		return true
	})
	counters := []struct {
		desc  *prometheus.Desc
		total uint64
	}{
		{c.reconnects, c.reconnectsRun.soFar(reconnects)},
		{c.reads, c.readsRun.soFar(reads)},
		{c.readsSent, c.readsSentRun.soFar(sent)},
	}
	if !found {
		return
	}
	upValue := 0.0
	if up {
		upValue = 1
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, upValue)
	for _, k := range counters {
		ch <- prometheus.MustNewConstMetric(k.desc, prometheus.CounterValue, float64(k.total))
	}
	ch <- prometheus.MustNewConstMetric(c.channels, prometheus.GaugeValue, float64(channels))
	ch <- prometheus.MustNewConstMetric(c.denied, prometheus.GaugeValue, float64(denied))
}

// runningCount is a counter summed over the hubs in use and those closed
// since the collector saw them.
type runningCount struct {
	seen map[any]uint64 // each hub's count (by its key in the pool) as last collected
	gone uint64         // the sum of those of the hubs closed since
}

// soFar returns the count of the hubs in use (now, by key) and of those
// closed since; the collector's mu is held. A hub whose count went down is
// a new one under the same key.
func (r *runningCount) soFar(now map[any]uint64) uint64 {
	for key, n := range r.seen {
		if m, ok := now[key]; !ok || m < n {
			r.gone += n
		}
	}
	r.seen = now
	total := r.gone
	for _, n := range now {
		total += n
	}
	return total
}

// Interface guards
var (
	_ caddy.Destructor     = (*metrics)(nil)
	_ prometheus.Collector = (*backendCollector)(nil)
)
