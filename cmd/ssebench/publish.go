package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// publisher publishes one event to one channel. The HTTP endpoint is the
// only implementation for now. Publishing straight into Redis
// (-publish-redis, once the Redis backend lands) is another implementation
// of this interface: it runs the backend's publish function for the channel
// with the same data; the scenarios do not change.
type publisher interface {
	publish(ctx context.Context, channel, event string, data []byte, idemKey string) error
	close()
}

// httpPublisher POSTs JSON to the sse route's publish endpoint.
type httpPublisher struct {
	url    string
	secret string
	client *http.Client
	tr     *http.Transport
}

func newHTTPPublisher(t *target, secret string, conns int, timeout time.Duration) *httpPublisher {
	tr := publishTransport(t, conns, timeout)
	scheme := "http"
	if t.tls {
		scheme = "https"
	}
	return &httpPublisher{
		url:    scheme + "://" + t.host + t.url.RequestURI(),
		secret: secret,
		tr:     tr,
		client: &http.Client{Transport: tr, Timeout: timeout},
	}
}

// publishTransport dials the target's checked address (never its name
// again), keeping up to conns connections.
func publishTransport(t *target, conns int, timeout time.Duration) *http.Transport {
	dialer := &net.Dialer{Timeout: timeout}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, t.addr.String())
		},
		MaxIdleConnsPerHost: conns,
		DisableCompression:  true,
	}
	if t.tls {
		tr.TLSClientConfig = insecureTLS()
	}
	return tr
}

type publishBody struct {
	Channel string          `json:"channel"`
	Event   string          `json:"event,omitempty"`
	Data    json.RawMessage `json:"data"`
}

func (p *httpPublisher) publish(ctx context.Context, channel, event string, data []byte, idemKey string) error {
	body, err := json.Marshal(publishBody{Channel: channel, Event: event, Data: data})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+p.secret)
	req.Header.Set("Content-Type", "application/json")
	if idemKey != "" {
		// also makes net/http retry the POST on a keep-alive connection
		// the server closed (as on a reload)
		req.Header.Set("Idempotency-Key", idemKey)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("publish: %s", shortErr(err))
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		err := fmt.Errorf("publish: status %d %s", resp.StatusCode, bytes.TrimSpace(reply))
		var failure struct {
			Key string `json:"idempotency_key"`
		}
		if json.Unmarshal(reply, &failure) == nil && failure.Key != "" {
			return &failedPublish{err: err, key: failure.Key}
		}
		return err
	}
	return nil
}

// failedPublish is a 503 that offers the key to retry the publish under
// (idempotency_key).
type failedPublish struct {
	err error
	key string
}

func (f *failedPublish) Error() string      { return f.err.Error() }
func (f *failedPublish) offeredKey() string { return f.key }

func (p *httpPublisher) close() { p.tr.CloseIdleConnections() }

// pubPlan is what to publish: count events at rate events/s (0: at once),
// event i to channel chanOf(i), by workers goroutines. When ordered, all
// events of a channel are published by the same goroutine, one after the
// other, so that the channel's order is the tool's sequence order (and a
// slow publish delays the next). Otherwise any free goroutine takes the next
// event on schedule, like independent backends; events of a channel may then
// overtake each other (counted as reordered, never as lost).
type pubPlan struct {
	channels []string
	count    int
	rate     float64
	chanOf   func(i int) int
	workers  int
	ordered  bool
	event    string
	pad      int
	idem     bool // Idempotency-Key per event, retried on errors
	// retryOffered: a failed publish without a key is retried under the
	// key its 503 offers (idempotency_key), every retryWait
	retryOffered bool
	retryWait    time.Duration
	retries      int
	// seqBase is the last sequence number already used per channel (by an
	// earlier plan on the same channels).
	seqBase []int64
}

// pubResult is what a plan published.
type pubResult struct {
	attempted atomic.Int64
	ok        atomic.Int64
	failed    atomic.Int64
	seqs      []int64 // the last sequence number used per channel
	ordered   bool
	start     time.Time
	end       time.Time

	mu   sync.Mutex
	rtt  histogram // request round trip
	lag  histogram // how late each publish started against its schedule
	errs map[string]int64
	// accepted are, per channel, the sequence numbers of the publishes
	// answered 200: the events a stream must receive. Counts would not do:
	// an event whose publish failed on the tool's side (a timeout) may
	// still be delivered, and would hide the loss of an accepted one.
	accepted []seqSet
}

type pubJob struct {
	ch  int
	seq int64
	due time.Time
}

// runPublish publishes plan, on schedule, until done or ctx ends.
func runPublish(ctx context.Context, pub publisher, plan pubPlan) *pubResult {
	res := &pubResult{
		seqs:     make([]int64, len(plan.channels)),
		errs:     map[string]int64{},
		ordered:  plan.ordered,
		accepted: make([]seqSet, len(plan.channels)),
	}
	copy(res.seqs, plan.seqBase)
	queues := pubQueues(plan)
	var runID [6]byte
	_, _ = rand.Read(runID[:])
	var wg sync.WaitGroup
	for _, q := range queues {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res.work(ctx, pub, plan, hex.EncodeToString(runID[:]), q)
		}()
	}
	res.start = time.Now()
	res.schedule(ctx, plan, queues)
	closed := map[chan pubJob]bool{}
	for _, q := range queues {
		if !closed[q] {
			closed[q] = true
			close(q)
		}
	}
	wg.Wait()
	res.end = time.Now()
	return res
}

// pubQueues are the publishing workers' queues: one each if a channel's
// events must go out in order (a channel's are all on one worker), else
// one that every worker takes from.
func pubQueues(plan pubPlan) []chan pubJob {
	queues := make([]chan pubJob, max(plan.workers, 1))
	var shared chan pubJob
	if !plan.ordered {
		shared = make(chan pubJob, max(plan.count, 1))
	}
	for w := range queues {
		queues[w] = shared
		if shared == nil {
			queues[w] = make(chan pubJob, max(plan.count, 1))
		}
	}
	return queues
}

// schedule queues the plan's events at its rate, until ctx ends.
func (res *pubResult) schedule(ctx context.Context, plan pubPlan, queues []chan pubJob) {
	interval := time.Duration(0)
	if plan.rate > 0 {
		interval = time.Duration(float64(time.Second) / plan.rate)
	}
	for i := range plan.count {
		due := res.start.Add(time.Duration(i) * interval)
		if d := time.Until(due); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return
			}
		}
		if ctx.Err() != nil {
			return
		}
		ch := plan.chanOf(i)
		res.seqs[ch]++
		queues[ch%len(queues)] <- pubJob{ch: ch, seq: res.seqs[ch], due: due}
	}
}

// work publishes the events of q, and counts them.
func (res *pubResult) work(ctx context.Context, pub publisher, plan pubPlan, runID string, q <-chan pubJob) {
	var data []byte
	for job := range q {
		key := ""
		if plan.idem {
			key = fmt.Sprintf("ssebench-%s-%d-%d", runID, job.ch, job.seq)
		}
		res.attempted.Add(1)
		began := time.Now()
		res.mu.Lock()
		res.lag.Record(began.Sub(job.due).Nanoseconds())
		res.mu.Unlock()
		// the same body on a retry: the Idempotency-Key covers it
		data = appendBenchData(data[:0], benchEvent{ch: int64(job.ch), seq: job.seq, t: monoOf(began)}, plan.pad)
		if err := res.publishOne(ctx, pub, plan, plan.channels[job.ch], data, key); err != nil {
			res.failed.Add(1)
			continue
		}
		res.ok.Add(1)
		res.mu.Lock()
		res.accepted[job.ch].add(job.seq)
		res.mu.Unlock()
	}
}

// publishOne publishes an event, retrying as the plan says: under its
// Idempotency-Key, or the one a 503 offered.
func (res *pubResult) publishOne(ctx context.Context, pub publisher, plan pubPlan, channel string, data []byte, key string) error {
	var err error
	for try := 0; try <= plan.retries; try++ {
		if ctx.Err() != nil {
			if err == nil {
				// never sent: a failure, not a success
				err = ctx.Err()
			}
			break
		}
		began := time.Now()
		err = pub.publish(ctx, channel, plan.event, data, key)
		res.mu.Lock()
		res.rtt.Record(time.Since(began).Nanoseconds())
		if err != nil {
			res.errs[errKind(err)]++
		}
		res.mu.Unlock()
		if key == "" && plan.retryOffered {
			key = offeredKey(err)
		}
		if err == nil || key == "" || !(plan.idem || plan.retryOffered) {
			break
		}
		time.Sleep(cmp.Or(plan.retryWait, 50*time.Millisecond))
	}
	return err
}

// publishSummary is the JSON of a pubResult.
type publishSummary struct {
	Attempted int64            `json:"attempted"`
	OK        int64            `json:"ok"`
	Failed    int64            `json:"failed"`
	Seconds   float64          `json:"seconds"`
	PerS      float64          `json:"per_s"`
	RTT       *latencySummary  `json:"rtt"`
	Lag       *latencySummary  `json:"schedule_lag"`
	Ordered   bool             `json:"ordered"`
	Errors    map[string]int64 `json:"errors,omitempty"`
}

func (r *pubResult) summary() *publishSummary {
	r.mu.Lock()
	defer r.mu.Unlock()
	secs := r.end.Sub(r.start).Seconds()
	s := &publishSummary{
		Attempted: r.attempted.Load(),
		OK:        r.ok.Load(),
		Failed:    r.failed.Load(),
		Seconds:   round3(secs),
		RTT:       r.rtt.Summary(),
		Lag:       r.lag.Summary(),
		Ordered:   r.ordered,
	}
	if secs > 0 {
		s.PerS = round3(float64(s.OK) / secs)
	}
	if len(r.errs) > 0 {
		s.Errors = r.errs
	}
	return s
}

// failedNote is the summary's mention of failed publishes, if any.
func failedNote(failed int64) string {
	if failed == 0 {
		return ""
	}
	return fmt.Sprintf(", %d FAILED", failed)
}

func insecureTLS() *tls.Config {
	return &tls.Config{InsecureSkipVerify: true} // loopback benchmarks against `tls internal`
}

func round3(f float64) float64 { return math.Round(f*1000) / 1000 }
