package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"time"
)

// reconnectStorm: open streams, give each a Last-Event-ID, reload the
// server, publish events meanwhile, and time until every client has
// reconnected and has every event.
func (r *runner) reconnectStorm() error {
	cfg := r.cfg
	ramp := r.ramp()
	if ramp.Connected == 0 {
		return errors.New("no stream opened")
	}
	sleepPhase("settle", cfg.settle)
	live := r.liveClients()
	pub := r.newPublisher()
	defer pub.close()
	ctx, cancel := context.WithTimeout(context.Background(), cfg.waitTimeout+cfg.reloadTimeout+30*time.Second)
	defer cancel()
	warm, err := r.warmUp(ctx, pub, live)
	if err != nil {
		return err
	}
	st := r.storm(ctx, pub, live, warm)
	t := r.reportStorm(st)
	return r.stormProblems(ramp, st, t)
}

// warmUp publishes one event per channel and waits until every client has
// it, so that every client has a Last-Event-ID when the storm begins.
func (r *runner) warmUp(ctx context.Context, pub publisher, live []*client) (*pubResult, error) {
	cfg := r.cfg
	setPhase("warm-up")
	warm := runPublish(ctx, pub, pubPlan{
		channels: r.names, count: len(r.names), chanOf: func(i int) int { return i }, workers: cfg.publishers, ordered: true,
		event: cfg.eventType, idem: true, retries: 10,
	})
	if f := warm.failed.Load(); f > 0 {
		// the clients of those channels would have no Last-Event-ID
		r.res.Publish = warm.summary()
		return nil, fmt.Errorf("warm-up: %d of %d publishes failed", f, warm.attempted.Load())
	}
	acc := acceptedPerChannel(warm)
	waitEnd := time.Now().Add(cfg.waitTimeout)
	for countDelivered(live, acc).lost > 0 {
		if time.Now().After(waitEnd) {
			return nil, fmt.Errorf("warm-up: %d clients did not get their first event", len(live)-countDelivered(live, acc).complete)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return warm, nil
}

// stormRun is what a reconnect storm measured.
type stormRun struct {
	live         []*client
	warm, pres   *pubResult   // the warm-up's publishes, the storm's
	baseConnects []int32      // each client's connections before the reload
	tot0         *statsTotals // the load tool's counts before the reload
	before       procSample
	haveServer   bool
	cpu0         float64
	t0           time.Time // the reload's start
	reloadStatus string
	// when every client had reconnected, and had every event (0: not within
	// the time limit); how many had reconnected by the end
	allReconnected, allEvents time.Duration
	reconnected               int
}

// storm reloads the server while publishing cfg.events, and watches the
// clients until every one has reconnected and has every event, or the
// time limit passes.
func (r *runner) storm(ctx context.Context, pub publisher, live []*client, warm *pubResult) *stormRun {
	cfg := r.cfg
	st := &stormRun{live: live, warm: warm, baseConnects: make([]int32, len(live))}
	for i, c := range live {
		st.baseConnects[i] = c.connects.Load()
	}
	// the latency reported is the storm's, as the deliveries are
	r.eng.core().resetLatency()
	st.tot0 = r.eng.core().totals()
	st.before, st.haveServer = r.sample()
	st.cpu0 = selfCPU()
	endBox := r.boxWindow()
	defer endBox()

	setPhase("reload")
	st.t0 = time.Now()
	reloadDone := r.reloadInBackground(ctx)
	pubDone := make(chan *pubResult, 1)
	n := len(r.names)
	go func() {
		pubDone <- runPublish(ctx, pub, pubPlan{
			channels: r.names, count: cfg.events, rate: cfg.rate, chanOf: func(i int) int { return i % n },
			workers: cfg.publishers, ordered: cfg.ordered, event: cfg.eventType, pad: cfg.pad, idem: true, retries: 20,
			seqBase: warm.seqs,
		})
	}()
	setPhase("storm")
	st.watch(pubDone, reloadDone, st.t0.Add(cfg.waitTimeout))
	if st.pres == nil {
		st.pres = <-pubDone // bounded by ctx
	}
	if st.reloadStatus == "" {
		select {
		case st.reloadStatus = <-reloadDone:
		case <-time.After(cfg.reloadTimeout):
			st.reloadStatus = "still running"
		}
	}
	return st
}

// reloadInBackground starts a reload; its status comes on the channel.
func (r *runner) reloadInBackground(ctx context.Context) <-chan string {
	done := make(chan string, 1)
	go func() {
		began := time.Now()
		err := r.reload(ctx)
		status := "ok"
		if err != nil {
			status = err.Error()
		}
		done <- fmt.Sprintf("%s in %.3fs", status, time.Since(began).Seconds())
	}()
	return done
}

// watch polls the clients until every one has reconnected and has every
// event published (once the publishing is done), or until deadline.
func (st *stormRun) watch(pubDone <-chan *pubResult, reloadDone <-chan string, deadline time.Time) {
	var acc []chanAccepted
	for {
		select {
		case st.pres = <-pubDone:
		case st.reloadStatus = <-reloadDone:
		default:
		}
		st.reconnected = 0
		for i, c := range st.live {
			if c.connects.Load() > st.baseConnects[i] {
				st.reconnected++
			}
		}
		if st.reconnected == len(st.live) && st.allReconnected == 0 {
			st.allReconnected = time.Since(st.t0)
		}
		if st.pres != nil {
			if acc == nil {
				acc = acceptedPerChannel(st.warm, st.pres)
			}
			if countDelivered(st.live, acc).lost == 0 && st.allEvents == 0 {
				st.allEvents = time.Since(st.t0)
			}
		}
		if (st.allReconnected > 0 && st.allEvents > 0) || time.Now().After(deadline) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// reportStorm fills the run's results from what the storm measured, and
// returns the final count of what each client received.
func (r *runner) reportStorm(st *stormRun) tally {
	cfg := r.cfg
	t := countDelivered(st.live, acceptedPerChannel(st.warm, st.pres))
	tot := r.eng.core().totals()
	after, _ := r.sample()
	stormSecs := time.Since(st.t0).Seconds()
	received := tot.received - st.tot0.received // in the storm, as fanout's in its window
	if st.haveServer {
		r.res.Server = r.serverSummary(st.before, st.before, after, stormSecs, received)
	}
	r.res.Client = r.clientSummary(st.cpu0, selfCPU(), stormSecs, received)
	budget := cfg.closeJitter + 5*time.Second
	rs := &reconnectSummary{
		Reload: st.reloadStatus, AllReconnectedS: round3(st.allReconnected.Seconds()), AllEventsS: round3(st.allEvents.Seconds()),
		BudgetS: budget.Seconds(), Clients: len(st.live), Reconnected: st.reconnected, Complete: t.complete,
		ServerClosing: tot.closing - st.tot0.closing, TruncatedReplays: tot.truncatedEvents - st.tot0.truncatedEvents,
	}
	if st.allReconnected > 0 && st.allEvents > 0 {
		done := max(st.allReconnected, st.allEvents)
		rs.DoneS = round3(done.Seconds())
		rs.WithinBudget = done <= budget
	}
	r.res.Reconnect = rs
	d := &deliverySummary{
		Clients: len(st.live), Expected: t.expected, Unique: t.unique, Received: received,
		Lost: t.lost, Dupes: tot.dupes, Reordered: tot.reordered, Extra: t.extra, Foreign: tot.foreign, Unparsed: tot.unparsed,
		Truncated: tot.truncatedEvents, Closing: tot.closing, Drained: t.lost == 0,
	}
	if stormSecs > 0 {
		// the publishing overlaps the whole storm: one window for both
		d.PerS = math.Round(float64(received) / stormSecs)
		d.OverallPerS = d.PerS
	}
	r.res.Delivery = d
	r.res.Latency = tot.lat.Summary()
	r.res.Publish = st.pres.summary()
	return t
}

// stormProblems says why a reconnect storm failed, if it did.
func (r *runner) stormProblems(ramp *rampSummary, st *stormRun, t tally) error {
	cfg := r.cfg
	var problems []string
	if ramp.Connected < int64(cfg.conns) {
		problems = append(problems, fmt.Sprintf("only %d of %d streams opened", ramp.Connected, cfg.conns))
	}
	if r.res.Reconnect.DoneS == 0 {
		problems = append(problems, fmt.Sprintf("not done within %s: %d of %d clients reconnected, %d complete", cfg.waitTimeout, st.reconnected, len(st.live), t.complete))
	}
	if t.lost > 0 {
		problems = append(problems, fmt.Sprintf("%d events lost", t.lost))
	}
	// as in fanout: duplicates, events of another channel, and (ordered
	// publishers) events out of order, such as a replay after live events
	problems = append(problems, deliveryFaults(r.res.Delivery, cfg.ordered, true)...)
	if f := st.pres.failed.Load(); f > 0 {
		// their events need not arrive: the loss count cannot vouch for them
		problems = append(problems, fmt.Sprintf("%d publishes failed", f))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// reload triggers a config reload: POST the config to the admin /load
// (forced with Cache-Control: must-revalidate, as `caddy reload --force`),
// or run -reload-cmd.
func (r *runner) reload(ctx context.Context) error {
	return r.reloadAt(ctx, r.cfg.admin)
}

// reloadAt is reload through the admin endpoint admin.
func (r *runner) reloadAt(ctx context.Context, admin string) error {
	cfg := r.cfg
	ctx, cancel := context.WithTimeout(ctx, cfg.reloadTimeout)
	defer cancel()
	if cfg.reloadCmd != "" {
		args := strings.Fields(cfg.reloadCmd)
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", cfg.reloadCmd, err, bytes.TrimSpace(out))
		}
		return nil
	}
	body, err := os.ReadFile(cfg.configPath)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+admin+"/load", bytes.NewReader(body))
	if err != nil {
		return err
	}
	ct := "text/caddyfile"
	if strings.HasSuffix(cfg.configPath, ".json") {
		ct = "application/json"
	}
	req.Header.Set("Content-Type", ct)
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := adminDo(admin, req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: %d %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}
