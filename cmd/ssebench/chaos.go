package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"
)

// -chaos puts faults into a fanout, spread or scaleout run while it
// publishes, to count what they cost: every -chaos-every the next of its
// actions, in turn. kill-redis kills the spawned Redis (SIGKILL) and starts
// it again on the same port after -chaos-down, with its append-only file
// synced at every write (so an acknowledged event survives: a loss is then
// the server's, not Redis'); stop-redis freezes it (SIGSTOP) for
// -chaos-down; reload POSTs -config to each server's admin in turn;
// kill-server kills the last -spawn server (SIGKILL: no server_closing, its
// streams just break) and starts it again after -chaos-down. Only processes
// this run started are touched, by their pids. Publishes answered 503
// with an offered idempotency_key are retried under it (up to
// chaosRetries × chaosRetryWait, within the 30 s Redis keeps a publish's
// token), so a publish that reached Redis and lost its answer is counted
// once, and the delivery check (lost, duplicated, out of order) covers it.

// chaosActions are the actions -chaos may name.
var chaosActions = []string{"kill-redis", "stop-redis", "reload", "kill-server"}

const (
	chaosRetries   = 250
	chaosRetryWait = 100 * time.Millisecond
)

// chaosEvent is one action taken, for the JSON line.
type chaosEvent struct {
	AtS    float64 `json:"at_s"`
	Action string  `json:"action"`
	Target string  `json:"target,omitempty"`
	DownS  float64 `json:"down_s,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// parseChaos splits -chaos into its actions, checking each.
func parseChaos(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var actions []string
	for a := range strings.SplitSeq(s, ",") {
		a = strings.TrimSpace(a)
		if !slices.Contains(chaosActions, a) {
			return nil, fmt.Errorf("-chaos: unknown action %q: want some of %s", a, strings.Join(chaosActions, ", "))
		}
		actions = append(actions, a)
	}
	return actions, nil
}

// checkChaos is defaults' check of the -chaos flags.
func (c *config) checkChaos() error {
	actions, err := parseChaos(c.chaos)
	switch {
	case err != nil:
		return err
	case len(actions) == 0:
		return nil
	case c.scenario != "fanout" && c.scenario != "spread" && c.scenario != "scaleout":
		return fmt.Errorf("-chaos: only fanout, spread and scaleout")
	case c.chaosEvery <= c.chaosDown || c.chaosDown <= 0:
		return fmt.Errorf("-chaos-every %s must be longer than -chaos-down %s > 0", c.chaosEvery, c.chaosDown)
	case c.spawnRedis == "" && (slices.Contains(actions, "kill-redis") || slices.Contains(actions, "stop-redis")):
		return fmt.Errorf("-chaos kill-redis and stop-redis need -spawn-redis (only the Redis this run started is touched)")
	case slices.Contains(actions, "reload") && (c.configPath == "" || c.admin == ""):
		return fmt.Errorf("-chaos reload needs -config and -admin")
	case slices.Contains(actions, "kill-server") && len(c.spawns) == 0:
		return fmt.Errorf("-chaos kill-server needs -spawn (only a server this run started is touched)")
	}
	return nil
}

// startChaos runs the actions until ctx ends; the returned function stops
// them once the action under way is done (Redis and the servers run
// again), and returns what was done.
func (r *runner) startChaos(ctx context.Context) func() []chaosEvent {
	actions, _ := parseChaos(r.cfg.chaos)
	if len(actions) == 0 {
		return func() []chaosEvent { return nil }
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan []chaosEvent, 1)
	start := time.Now()
	go func() {
		var events []chaosEvent
		reloads := 0
		for i := 0; ; i++ {
			if !sleepCtx(ctx, r.cfg.chaosEvery) {
				break
			}
			ev := chaosEvent{AtS: round3(time.Since(start).Seconds()), Action: actions[i%len(actions)]}
			if ev.Action == "reload" {
				// each server in turn
				ev.Target = r.cfg.admins[reloads%len(r.cfg.admins)]
				reloads++
			}
			r.chaosAct(ctx, &ev)
			events = append(events, ev)
			if !r.cfg.quiet {
				fmt.Fprintf(r.stderr, "ssebench: chaos at %.1fs: %s %s %s\n", ev.AtS, ev.Action, ev.Target, ev.Error)
			}
		}
		done <- events
	}()
	return func() []chaosEvent {
		cancel()
		return <-done
	}
}

// chaosAct takes one action; Redis and the servers run again when it
// returns.
func (r *runner) chaosAct(ctx context.Context, ev *chaosEvent) {
	down := r.cfg.chaosDown
	var err error
	switch ev.Action {
	case "kill-redis":
		err = r.killRedis(down)
		ev.DownS = round3(down.Seconds())
	case "stop-redis":
		err = r.signalRedis(syscall.SIGSTOP)
		if err == nil {
			time.Sleep(down) // not cut short: Redis must run again
			err = r.signalRedis(syscall.SIGCONT)
		}
		ev.DownS = round3(down.Seconds())
	case "reload":
		// not cut short by the stop: a reload under way completes
		err = r.reloadAt(context.WithoutCancel(ctx), ev.Target)
	case "kill-server":
		ev.Target, err = r.killServer(down)
		ev.DownS = round3(down.Seconds())
	}
	if err != nil {
		ev.Error = err.Error()
	}
}

// signalRedis sends sig to the spawned Redis.
func (r *runner) signalRedis(sig syscall.Signal) error {
	r.mu.Lock()
	rds := r.redis
	r.mu.Unlock()
	if rds == nil || rds.exited() {
		return fmt.Errorf("no spawned redis-server running")
	}
	return rds.cmd.Process.Signal(sig)
}

// killRedis kills the spawned Redis, waits down, and starts it again.
func (r *runner) killRedis(down time.Duration) error {
	r.mu.Lock()
	rds := r.redis
	r.mu.Unlock()
	if rds == nil {
		return fmt.Errorf("no spawned redis-server")
	}
	_ = rds.cmd.Process.Kill()
	if len(waitExited([]*proc{rds}, 5*time.Second)) > 0 {
		return fmt.Errorf("redis-server pid %d did not exit", rds.pid())
	}
	r.redisKilled = true
	time.Sleep(down)
	return r.startRedis()
}

// killServer kills the last spawned server (the one not published
// through, when there are several), waits down, starts it again and waits
// until it listens; it returns the server's name.
func (r *runner) killServer(down time.Duration) (string, error) {
	r.mu.Lock()
	i := len(r.servers) - 1
	old := r.servers[i]
	r.pids[i] = 0 // sample reads it no more
	r.mu.Unlock()
	_ = old.cmd.Process.Kill()
	if len(waitExited([]*proc{old}, 5*time.Second)) > 0 {
		return old.name, fmt.Errorf("pid %d did not exit", old.pid())
	}
	r.serverKilled = true
	time.Sleep(down)
	logf, err := os.OpenFile(old.log, os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return old.name, err
	}
	p, err := r.startServer(i, logf)
	if err != nil {
		return old.name, err
	}
	r.mu.Lock()
	r.servers[i] = p
	r.pids[i] = p.pid()
	r.mu.Unlock()
	deadline := time.Now().Add(r.cfg.spawnWait)
	for !treeListens(p.pid()) {
		if p.exited() || time.Now().After(deadline) {
			return old.name, fmt.Errorf("restarted, but not listening (log: %s)", p.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return old.name, nil
}

// sleepCtx sleeps for d; false if ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// offeredKey is the idempotency_key of a failed publish's 503, if any.
func offeredKey(err error) string {
	if k, ok := err.(interface{ offeredKey() string }); ok {
		return k.offeredKey()
	}
	return ""
}

// errKind is err's message for the count of publish errors: without the
// key a 503 offers, which differs in every one.
func errKind(err error) string {
	if k := offeredKey(err); k != "" {
		return strings.Replace(err.Error(), k, "<key>", 1)
	}
	return err.Error()
}
