package main

import (
	"math/bits"
	"net/netip"
	"net/url"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// target is a URL that streams are opened on.
type target struct {
	raw     string
	url     *url.URL
	addr    netip.AddrPort // resolved (the first loopback address)
	host    string         // the Host header
	tls     bool
	index   int
	streams atomic.Int64 // clients assigned to it
}

// requestURI returns the request URI of a stream on channels: the target's
// URL with {ch} replaced, or with channels=<list> added to its query.
func (t *target) requestURI(channels []string) string {
	list := url.QueryEscape(strings.Join(channels, ","))
	if strings.Contains(t.raw, "{ch}") {
		u, err := url.Parse(strings.ReplaceAll(t.raw, "{ch}", list))
		if err == nil {
			return u.RequestURI()
		}
	}
	uri := t.url.RequestURI()
	sep := "?"
	if strings.Contains(uri, "?") {
		sep = "&"
	}
	return uri + sep + "channels=" + list
}

// client is one simulated EventSource: its channels, what it received per
// channel, and its connection state. The engine goroutine that owns the
// client is the only writer of its fields, except the atomics, which the
// scenario reads while it runs.
type client struct {
	id        int
	tgt       *target
	chans     []int64 // channel indices, as in the events' "c" field
	uri       string
	reconnect bool          // like a browser: reconnect after the stream ends
	hold      time.Duration // close the stream after this long (0: never)

	seen   []seqSet       // the sequence numbers received per slot
	uniq   []atomic.Int64 // distinct events per slot
	parser sseParser
	st     *stats
	now    int64 // monoNow of the read being parsed

	everConnected atomic.Bool
	connects      atomic.Int32
	closingSeen   atomic.Int32 // server_closing events received

	// epoll engine state (owned by the client's worker)
	fd      int
	state   int
	gen     uint32
	head    []byte
	chunk   chunkDecoder
	chunked bool
	bodyLen int64 // remaining body bytes when a Content-Length was sent, else -1
	req     []byte
	reqOff  int
	opened  int64 // monoNow when the current attempt began
}

func newClient(id int, tgt *target, chans []int64, names []string, reconnect bool, hold time.Duration, st *stats) *client {
	c := &client{
		id:        id,
		tgt:       tgt,
		chans:     chans,
		uri:       tgt.requestURI(names),
		reconnect: reconnect,
		hold:      hold,
		seen:      make([]seqSet, len(chans)),
		uniq:      make([]atomic.Int64, len(chans)),
		st:        st,
		fd:        -1,
	}
	c.parser = newSSEParser(c.onEvent)
	tgt.streams.Add(1)
	return c
}

func (c *client) slot(ch int64) int {
	for i, x := range c.chans {
		if x == ch {
			return i
		}
	}
	return -1
}

// onEvent is called by the parser, with c.st locked by the caller.
func (c *client) onEvent(typ, data, _ []byte) {
	st := c.st
	switch string(typ) {
	case "server_closing":
		c.closingSeen.Add(1)
		st.closing++
		return
	case "sse_truncated":
		st.truncatedEvents++
		return
	case "sse_rejected", "sse_degraded":
		st.moduleEvents++
		return
	}
	ev, ok := parseBenchData(data)
	if !ok {
		st.unparsed++
		return
	}
	s := c.slot(ev.ch)
	if s < 0 {
		st.foreign++
		return
	}
	if ev.seq < 1 || ev.seq > maxSeq {
		st.foreign++
		return
	}
	set := &c.seen[s]
	if set.has(ev.seq) {
		st.dupes++
		return
	}
	if ev.seq < set.max {
		// out of order: a loss the server repaired late, or publishes
		// that overtook each other (-ordered=false)
		st.reordered++
	}
	set.add(ev.seq)
	c.uniq[s].Add(1)
	// only here: a duplicate (a replay's, say) would inflate the
	// deliveries/s and bring its own, late, latency
	st.lat.Record(c.now - ev.t)
	st.received.Add(1)
}

// maxSeq bounds the sequence numbers tracked (the bitset of one channel).
const maxSeq = 1 << 24

// seqSet is the set of sequence numbers (≥ 1) a client received on one
// channel: exact loss and duplicate counts even when events arrive out of
// order, at one bit per event.
type seqSet struct {
	bits []uint64
	max  int64
}

func (s *seqSet) has(seq int64) bool {
	w := int(seq >> 6)
	return w < len(s.bits) && s.bits[w]&(1<<(seq&63)) != 0
}

func (s *seqSet) add(seq int64) {
	w := int(seq >> 6)
	if w >= len(s.bits) {
		s.bits = append(s.bits, make([]uint64, w+1-len(s.bits)+len(s.bits)/2)...)
	}
	s.bits[w] |= 1 << (seq & 63)
	s.max = max(s.max, seq)
}

// countAbove returns how many members are greater than n (≥ 0).
func (s *seqSet) countAbove(n int64) int64 {
	if s.max <= n {
		return 0
	}
	var c int64
	first := int((n + 1) >> 6)
	for w := first; w < len(s.bits); w++ {
		x := s.bits[w]
		if w == first {
			x &^= 1<<((n+1)&63) - 1 // the members ≤ n
		}
		c += int64(bits.OnesCount64(x))
	}
	return c
}

// union adds the members of o.
func (s *seqSet) union(o *seqSet) {
	if n := len(o.bits) - len(s.bits); n > 0 {
		s.bits = append(s.bits, make([]uint64, n)...)
	}
	for w, x := range o.bits {
		s.bits[w] |= x
	}
	s.max = max(s.max, o.max)
}

// feed parses body bytes read at now.
func (c *client) feed(b []byte, now int64) error {
	c.st.mu.Lock()
	c.now = now
	before := c.parser.comments
	err := c.parser.Feed(b)
	c.st.comments += c.parser.comments - before
	c.st.mu.Unlock()
	return err
}

// retryDelay is the reconnection time: the last retry: field, or the
// default a browser uses before it got one.
func (c *client) retryDelay(def time.Duration) time.Duration {
	if r := c.parser.retry; r >= 0 {
		return time.Duration(r) * time.Millisecond
	}
	return def
}

// lastEventID returns the client's Last-Event-ID ("" if none). Only the
// owner goroutine may call it.
func (c *client) lastEventID() string { return string(c.parser.lastID) }

// stats is where a group of clients records: one per epoll worker, or a
// shard of the goroutine engine. mu guards everything but the atomics.
type stats struct {
	mu      sync.Mutex
	lat     histogram // publish → receive, of the received events
	connLat histogram // attempt → response head
	// received counts the distinct events of the clients' channels (no
	// duplicate, no foreign one): the deliveries.
	received        atomic.Int64
	dupes           int64
	reordered       int64
	foreign         int64
	unparsed        int64 // events without the tool's data: a rival server's own messages
	closing         int64
	truncatedEvents int64
	moduleEvents    int64
	comments        int64
}

// counters are the engine-wide connection counts.
type counters struct {
	attempts       atomic.Int64 // connection attempts (first ones and reconnects)
	connected      atomic.Int64 // attempts that got a 200 response head
	firstConnected atomic.Int64 // clients connected at least once
	live           atomic.Int64 // open streams right now
	failed         atomic.Int64 // failed attempts
	gaveUp         atomic.Int64 // clients that stopped (non-200, like EventSource)
	ended          atomic.Int64 // streams ended by the server
	closedByUs     atomic.Int64 // streams the tool closed (hold, shutdown)
	reconnects     atomic.Int64 // attempts after a stream ended or failed
	truncatedHead  atomic.Int64 // responses with X-Replay-Truncated: true
	dials          atomic.Int64 // TCP connections dialed (goroutine engine)
	waits          atomic.Int64 // epoll_wait calls that returned events (epoll engine)
	ready          atomic.Int64 // readiness events they returned
	reads          atomic.Int64 // read(2) calls on streams (epoll engine)
}

// engineOpts are the settings every engine takes.
type engineOpts struct {
	srcs         []netip.Addr  // source addresses to spread connections over
	headTimeout  time.Duration // bound on connect + response head
	defaultRetry time.Duration // reconnection time before a retry: field
	workers      int           // epoll workers
	uring        bool          // epoll workers read through io_uring where allowed
	proto        string        // h1 or h2 (TLS targets, goroutine engine)
	h2Conns      int           // transports (so at least this many connections) for h2
	readBuf      int           // per-connection read buffer (goroutine engine)
}

// core is the state every engine shares.
type core struct {
	opts    engineOpts
	cnt     counters
	shards  []*stats
	srcNext atomic.Uint64

	errMu sync.Mutex
	errs  map[string]int64
}

func newCore(opts engineOpts, shards int) *core {
	k := &core{opts: opts, errs: map[string]int64{}}
	for range max(shards, 1) {
		k.shards = append(k.shards, &stats{})
	}
	return k
}

func (k *core) noteErr(kind string) {
	k.errMu.Lock()
	k.errs[kind]++
	k.errMu.Unlock()
}

func (k *core) errors() map[string]int64 {
	k.errMu.Lock()
	defer k.errMu.Unlock()
	out := make(map[string]int64, len(k.errs))
	for e, n := range k.errs {
		out[e] = n
	}
	return out
}

// nextSrc returns the next source address, round robin (invalid if none).
func (k *core) nextSrc() netip.Addr {
	if len(k.opts.srcs) == 0 {
		return netip.Addr{}
	}
	return k.opts.srcs[(k.srcNext.Add(1)-1)%uint64(len(k.opts.srcs))]
}

// statsTotals is a snapshot of every shard.
type statsTotals struct {
	lat             histogram
	connLat         histogram
	received        int64
	dupes           int64
	reordered       int64
	foreign         int64
	unparsed        int64 // events without the tool's data: a rival server's own messages
	closing         int64
	truncatedEvents int64
	moduleEvents    int64
	comments        int64
}

func (k *core) totals() *statsTotals {
	t := &statsTotals{}
	for _, s := range k.shards {
		s.mu.Lock()
		t.lat.Merge(&s.lat)
		t.connLat.Merge(&s.connLat)
		t.dupes += s.dupes
		t.reordered += s.reordered
		t.foreign += s.foreign
		t.unparsed += s.unparsed
		t.closing += s.closing
		t.truncatedEvents += s.truncatedEvents
		t.moduleEvents += s.moduleEvents
		t.comments += s.comments
		s.mu.Unlock()
		t.received += s.received.Load()
	}
	return t
}

// resetLatency forgets the publish → receive latencies recorded so far: a
// phase before the measured one (the reconnect storm's warm-up, delivered
// to quiet streams) would pull its percentiles down.
func (k *core) resetLatency() {
	for _, s := range k.shards {
		s.mu.Lock()
		s.lat = histogram{}
		s.mu.Unlock()
	}
}

func (k *core) received() int64 {
	var n int64
	for _, s := range k.shards {
		n += s.received.Load()
	}
	return n
}

// engine opens and holds the streams of clients.
type engine interface {
	// start begins connecting c; it returns at once.
	start(c *client)
	// shardFor returns the stats a new client records into.
	shardFor(id int) *stats
	// closeAll closes every stream, stops reconnecting and waits (at most
	// timeout) for the engine to stop.
	closeAll(timeout time.Duration) error
	core() *core
	name() string
}

// sortedErrs renders an error map deterministically for the summary.
func sortedErrs(m map[string]int64) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
