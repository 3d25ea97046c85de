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

	// one event per channel, so that every client has a Last-Event-ID
	setPhase("warm-up")
	n := len(r.names)
	warm := runPublish(ctx, pub, pubPlan{
		channels: r.names, count: n, chanOf: func(i int) int { return i }, workers: cfg.publishers, ordered: true,
		event: cfg.eventType, idem: true, retries: 10,
	})
	if f := warm.failed.Load(); f > 0 {
		// the clients of those channels would have no Last-Event-ID
		r.res.Publish = warm.summary()
		return fmt.Errorf("warm-up: %d of %d publishes failed", f, warm.attempted.Load())
	}
	accWarm := acceptedPerChannel(warm)
	waitEnd := time.Now().Add(cfg.waitTimeout)
	for countDelivered(live, accWarm).lost > 0 {
		if time.Now().After(waitEnd) {
			return fmt.Errorf("warm-up: %d clients did not get their first event", len(live)-countDelivered(live, accWarm).complete)
		}
		time.Sleep(10 * time.Millisecond)
	}
	baseConnects := make([]int32, len(live))
	for i, c := range live {
		baseConnects[i] = c.connects.Load()
	}
	// the latency reported is the storm's, as the deliveries are
	r.eng.core().resetLatency()
	tot0 := r.eng.core().totals()
	before, haveServer := r.sample()
	cpu0 := selfCPU()
	endBox := r.boxWindow()

	setPhase("reload")
	t0 := time.Now()
	reloadDone := make(chan string, 1)
	go func() {
		began := time.Now()
		err := r.reload(ctx)
		status := "ok"
		if err != nil {
			status = err.Error()
		}
		reloadDone <- fmt.Sprintf("%s in %.3fs", status, time.Since(began).Seconds())
	}()
	pubDone := make(chan *pubResult, 1)
	go func() {
		pubDone <- runPublish(ctx, pub, pubPlan{
			channels: r.names, count: cfg.events, rate: cfg.rate, chanOf: func(i int) int { return i % n },
			workers: cfg.publishers, ordered: cfg.ordered, event: cfg.eventType, pad: cfg.pad, idem: true, retries: 20,
			seqBase: warm.seqs,
		})
	}()
	var (
		pres                      *pubResult
		acc                       []chanAccepted
		reloadStatus              string
		allReconnected, allEvents time.Duration
		t                         tally
		reconnected               int
	)
	setPhase("storm")
	deadline := t0.Add(cfg.waitTimeout)
	for {
		select {
		case pres = <-pubDone:
		case reloadStatus = <-reloadDone:
		default:
		}
		reconnected = 0
		for i, c := range live {
			if c.connects.Load() > baseConnects[i] {
				reconnected++
			}
		}
		if reconnected == len(live) && allReconnected == 0 {
			allReconnected = time.Since(t0)
		}
		if pres != nil {
			if acc == nil {
				acc = acceptedPerChannel(warm, pres)
			}
			t = countDelivered(live, acc)
			if t.lost == 0 && allEvents == 0 {
				allEvents = time.Since(t0)
			}
		}
		if allReconnected > 0 && allEvents > 0 {
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	done := max(allReconnected, allEvents)
	if pres == nil {
		pres = <-pubDone // bounded by ctx
	}
	if reloadStatus == "" {
		select {
		case reloadStatus = <-reloadDone:
		case <-time.After(cfg.reloadTimeout):
			reloadStatus = "still running"
		}
	}
	t = countDelivered(live, acceptedPerChannel(warm, pres))
	tot := r.eng.core().totals()
	endBox()
	after, _ := r.sample()
	stormSecs := time.Since(t0).Seconds()
	received := tot.received - tot0.received // in the storm, as fanout's in its window
	if haveServer {
		r.res.Server = r.serverSummary(before, before, after, stormSecs, received)
	}
	r.res.Client = r.clientSummary(cpu0, selfCPU(), stormSecs, received)
	budget := cfg.closeJitter + 5*time.Second
	rs := &reconnectSummary{
		Reload: reloadStatus, AllReconnectedS: round3(allReconnected.Seconds()), AllEventsS: round3(allEvents.Seconds()),
		BudgetS: budget.Seconds(), Clients: len(live), Reconnected: reconnected, Complete: t.complete,
		ServerClosing: tot.closing - tot0.closing, TruncatedReplays: tot.truncatedEvents - tot0.truncatedEvents,
	}
	if allReconnected > 0 && allEvents > 0 {
		rs.DoneS = round3(done.Seconds())
		rs.WithinBudget = done <= budget
	}
	r.res.Reconnect = rs
	d := &deliverySummary{
		Clients: len(live), Expected: t.expected, Unique: t.unique, Received: received,
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
	r.res.Publish = pres.summary()
	var problems []string
	if ramp.Connected < int64(cfg.conns) {
		problems = append(problems, fmt.Sprintf("only %d of %d streams opened", ramp.Connected, cfg.conns))
	}
	if rs.DoneS == 0 {
		problems = append(problems, fmt.Sprintf("not done within %s: %d of %d clients reconnected, %d complete", cfg.waitTimeout, reconnected, len(live), t.complete))
	}
	if t.lost > 0 {
		problems = append(problems, fmt.Sprintf("%d events lost", t.lost))
	}
	// as in fanout: duplicates, events of another channel, and (ordered
	// publishers) events out of order, such as a replay after live events
	problems = append(problems, deliveryFaults(d, cfg.ordered, true)...)
	if f := pres.failed.Load(); f > 0 {
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
