package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// streamSet is where the measured streams are: this process' engine, or
// the subscriber workers of -procs.
type streamSet interface {
	// open opens the streams (the ramp); it fills in r.res.Ramp.
	open() (*rampSummary, error)
	// begin fixes the streams that count: those that connected.
	begin() error
	// received is how many events the streams received so far.
	received() (int64, error)
	// count compares what the streams received with what the server
	// accepted per channel.
	count(acc []chanAccepted) (tally, error)
	// totals are the final figures (latency and the rest).
	totals() (*statsTotals, error)
}

// localStreams are the streams of this process.
type localStreams struct {
	r    *runner
	live []*client
}

func (l *localStreams) open() (*rampSummary, error) { return l.r.ramp(), nil }
func (l *localStreams) begin() error {
	l.live = l.r.liveClients()
	return nil
}
func (l *localStreams) received() (int64, error) { return l.r.eng.core().received(), nil }
func (l *localStreams) count(acc []chanAccepted) (tally, error) {
	return countDelivered(l.live, acc), nil
}
func (l *localStreams) totals() (*statsTotals, error) { return l.r.eng.core().totals(), nil }

// deliver is fanout, spread and scaleout: streams over channels, events
// published at a rate for a duration; latency, throughput, losses, CPU.
func (r *runner) deliver(ss streamSet) error {
	cfg := r.cfg
	base, haveServer := r.sample()
	ramp, err := ss.open()
	if err != nil {
		return err
	}
	if ramp.Connected == 0 {
		return errors.New("no stream opened")
	}
	sleepPhase("settle", cfg.settle)
	if err := ss.begin(); err != nil {
		return err
	}
	pub := r.newPublisher()
	defer pub.close()

	run := &deliveryRun{ss: ss, base: base, haveServer: haveServer}
	run.before, _ = r.sample()
	run.cpu0 = r.clientCPU()
	if run.recv0, err = ss.received(); err != nil {
		return err
	}
	endBox := r.boxWindow()
	waitProfile := r.startCPUProfile(cfg.duration)
	ctx, cancel := context.WithTimeout(context.Background(), cfg.duration+cfg.drain+30*time.Second)
	defer cancel()
	if err := r.publishPhase(ctx, pub, run); err != nil {
		return err
	}
	if err := r.drainPhase(run); err != nil {
		return err
	}
	endBox()
	run.after, _ = r.sample()
	run.cpu1 = r.clientCPU()
	recvNow, err := ss.received()
	if err != nil {
		return err
	}
	run.recvAll = recvNow - run.recv0
	waitProfile()
	if err := r.reportDelivery(run); err != nil {
		return err
	}
	return r.deliveryProblems(ramp, run)
}

// deliveryRun is what a fan-out, spread or scale-out run measured.
type deliveryRun struct {
	ss                   streamSet
	base, before, after  procSample // the server before the ramp, before and after publishing
	haveServer           bool
	cpu0, cpu1           float64 // the load tool's CPU seconds
	recv0, recvAll       int64   // deliveries before publishing; from then to the drain's end
	recvPub              int64   // deliveries while publishing
	pres                 *pubResult
	t                    tally // what each client has of what was accepted
	drained              bool
	drainStart, drainEnd time.Time
}

// publishPhase publishes cfg.rate events/s for cfg.duration (with the
// faults of -chaos meanwhile) and counts what arrived while it did.
func (r *runner) publishPhase(ctx context.Context, pub publisher, run *deliveryRun) error {
	cfg := r.cfg
	setPhase("publish")
	n := len(r.names)
	plan := pubPlan{
		channels: r.names,
		count:    int(math.Round(cfg.rate * cfg.duration.Seconds())),
		rate:     cfg.rate,
		chanOf:   func(i int) int { return i % n },
		workers:  cfg.publishers,
		ordered:  cfg.ordered,
		event:    cfg.eventType,
		pad:      cfg.pad,
	}
	if cfg.chaos != "" {
		plan.retryOffered, plan.retries, plan.retryWait = true, chaosRetries, chaosRetryWait
	}
	stopChaos := r.startChaos(ctx)
	run.pres = runPublish(ctx, pub, plan)
	// what arrived while publishing, before waiting for a fault under way
	recvEnd, errEnd := run.ss.received()
	r.res.Chaos = stopChaos()
	if errEnd != nil {
		return errEnd
	}
	for _, c := range r.res.Chaos {
		if c.Error != "" {
			return fmt.Errorf("chaos at %.1fs: %s: %s", c.AtS, c.Action, c.Error)
		}
	}
	run.recvPub = recvEnd - run.recv0
	return nil
}

// drainPhase waits until every client has every accepted event, or
// cfg.drain passes.
func (r *runner) drainPhase(run *deliveryRun) error {
	setPhase("drain")
	acc := acceptedPerChannel(run.pres)
	run.drainStart = time.Now()
	defer func() { run.drainEnd = time.Now() }()
	for {
		t, err := run.ss.count(acc)
		if err != nil {
			return err
		}
		run.t = t
		if t.lost == 0 {
			run.drained = true
			return nil
		}
		if time.Since(run.drainStart) > r.cfg.drain {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// reportDelivery fills the run's results from what it measured.
func (r *runner) reportDelivery(run *deliveryRun) error {
	tot, err := run.ss.totals()
	if err != nil {
		return err
	}
	t, pres := run.t, run.pres
	d := &deliverySummary{
		Clients: t.clients, Expected: t.expected, Unique: t.unique, Received: run.recvAll,
		Lost: t.lost, Dupes: tot.dupes, Reordered: tot.reordered, Extra: t.extra, Foreign: tot.foreign, Unparsed: tot.unparsed,
		Truncated: tot.truncatedEvents, Closing: tot.closing,
		DrainSeconds: round3(run.drainEnd.Sub(run.drainStart).Seconds()), Drained: run.drained,
	}
	if pubSecs := pres.end.Sub(pres.start).Seconds(); pubSecs > 0 {
		d.PerS = math.Round(float64(run.recvPub) / pubSecs)
	}
	// from the publishing's start to the drain's end: with the wait for
	// the last fault of -chaos (and the tally) between the two, whose
	// deliveries and CPU are counted too
	window := run.drainEnd.Sub(pres.start).Seconds()
	if window > 0 {
		d.OverallPerS = math.Round(float64(run.recvAll) / window)
	}
	r.res.Delivery = d
	r.res.Latency = tot.lat.Summary()
	r.res.Publish = pres.summary()
	switch {
	case r.serverKilled:
		r.note("no server figures: -chaos killed and restarted a server")
	case run.haveServer:
		r.res.Server = r.serverSummary(run.base, run.before, run.after, window, run.recvAll)
	}
	r.res.Client = r.clientSummary(run.cpu0, run.cpu1, window, run.recvAll)
	return nil
}

// deliveryProblems says why a delivery run failed, if it did.
func (r *runner) deliveryProblems(ramp *rampSummary, run *deliveryRun) error {
	cfg := r.cfg
	var problems []string
	if ramp.Connected < int64(cfg.conns) {
		problems = append(problems, fmt.Sprintf("only %d of %d streams opened", ramp.Connected, cfg.conns))
	}
	if !run.drained {
		problems = append(problems, fmt.Sprintf("%d of %d deliveries missing after the %s drain limit", run.t.lost, run.t.expected, cfg.drain))
	}
	switch n := run.pres.failed.Load(); {
	case n > 0 && cfg.chaos != "":
		// a fault may refuse a publish (a reload resets a connection
		// that reached the old socket): what it costs is counted, but
		// only losses, duplicates and reorders fail a chaos run
		r.note(fmt.Sprintf("%d publishes failed under -chaos (not accepted, so not expected; a delivered one counts as extra)", n))
	case n > 0:
		problems = append(problems, fmt.Sprintf("%d publishes failed", n))
	}
	problems = append(problems, deliveryFaults(r.res.Delivery, cfg.ordered, cfg.publishAs == "caddy-sse")...)
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// deliveryFaults are what a correct server never does, whatever the load:
// deliver an event twice, to a stream of another channel, or (with ordered
// publishers) out of order; and, when strict (caddy-sse), an event whose
// data is not the tool's (other servers send messages of their own, like
// Centrifugo's connect reply). A run that saw any fails, as one that lost
// events does.
func deliveryFaults(d *deliverySummary, ordered, strict bool) []string {
	var faults []string
	if d.Dupes > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries duplicated", d.Dupes))
	}
	if ordered && d.Reordered > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries out of order", d.Reordered))
	}
	if d.Foreign > 0 {
		faults = append(faults, fmt.Sprintf("%d deliveries to a stream of another channel", d.Foreign))
	}
	if strict && d.Unparsed > 0 {
		faults = append(faults, fmt.Sprintf("%d events whose data is not the tool's", d.Unparsed))
	}
	return faults
}
