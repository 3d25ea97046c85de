// Command ssebench is a load generator for the caddy-sse handler (or any
// Server-Sent Events server with the same publish endpoint). It opens many
// SSE streams to loopback targets, publishes timestamped events through the
// HTTP publish endpoint (or straight into Redis, -publish-redis) and reports
// deliveries/s, publish→receive latency, lost and duplicated events, the
// connection rate, and the servers' (and a spawned Redis') memory and CPU
// from /proc.
//
//	ssebench <scenario> [flags]
//
// Scenarios: idle, fanout, spread, churn, reconnect, scaleout.
// `ssebench floor-server` is a bare reference server for the machine's
// floor (one write per delivery, nothing else). `ssebench grip-backend` is
// the backend that Pushpin needs for the side-by-side runs (-publish-as).
// `ssebench subscribe-worker`
// is the hidden child of -procs (it holds a share of the streams). Run
// `ssebench -h` for the flags, and see docs/PERFORMANCE.md and the Makefile
// for the commands behind the published figures.
//
// It refuses any target that is not a loopback address, bounds every phase
// in time and always terminates (a watchdog ends the run after -timeout).
// It prints one JSON line per run on stdout and a summary on stderr.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

var scenarios = []string{"idle", "fanout", "spread", "churn", "reconnect", "scaleout"}

// config holds the flags.
type config struct {
	scenario      string
	urls          []string
	publishURL    string
	secret        string
	conns         int
	channels      int
	perConn       int
	channelPrefix string
	engine        string
	proto         string
	h2Conns       int
	workers       int
	uring         bool
	src           string
	inflight      int
	readBuf       int

	rate       float64
	duration   time.Duration
	events     int
	pad        int
	publishers int
	ordered    bool
	eventType  string
	reconnect  bool
	connRate   float64
	hold       time.Duration

	rampTimeout    time.Duration
	settle         time.Duration
	drain          time.Duration
	headTimeout    time.Duration
	publishTimeout time.Duration
	reloadTimeout  time.Duration
	waitTimeout    time.Duration
	totalTimeout   time.Duration
	defaultRetry   time.Duration
	closeJitter    time.Duration
	idleHold       time.Duration
	quietWait      time.Duration
	quietCores     float64

	pid        int
	spawns     []string // -spawn, once per server
	spawnLog   string
	spawnWait  time.Duration
	admin      string   // the first -admin: reloads and profiles
	admins     []string // every -admin: goroutines and memstats are summed
	configPath string
	reloadCmd  string

	spawnRedis   string // redis-server binary to start privately
	redisPort    int
	publishRedis string // a redis:// URL, or "spawned"
	publishAs    string // the publish API: caddy-sse, or one of rivals
	redisPrefix  string
	redisHistory int

	chaos      string // faults while publishing (chaos.go)
	chaosEvery time.Duration
	chaosDown  time.Duration

	procs  int // subscriber processes (fanout, spread, scaleout)
	idBase int // subscribe-worker: the first client id

	serverCPUProfile  string
	serverHeapProfile string
	cpuProfile        string
	out               string
	label             string
	quiet             bool

	set      map[string]bool // flags given on the command line
	urlsFlag *string
}

func (c *config) flags(fs *flag.FlagSet) {
	var urls string
	fs.StringVar(&urls, "url", "http://127.0.0.1:9080/events", "stream URL(s), comma-separated (several for scaleout); {ch} is replaced by the channel list, else channels=<list> is added to the query")
	fs.Func("urls", "alias of -url", func(s string) error { urls = s; return nil })
	fs.StringVar(&c.publishURL, "publish-url", "", "publish endpoint (default: the first -url without its query)")
	fs.StringVar(&c.secret, "secret", "bench", "publish bearer secret")
	fs.IntVar(&c.conns, "conns", 10000, "streams to open")
	fs.IntVar(&c.channels, "channels", 0, "channels (default per scenario: idle/spread 1000, fanout/reconnect/scaleout 1, churn 100)")
	fs.IntVar(&c.perConn, "per-conn", 1, "channels per stream")
	fs.StringVar(&c.channelPrefix, "channel-prefix", "bench", "channel names are <prefix><n>")
	fs.StringVar(&c.engine, "engine", "epoll", "client engine: epoll (raw sockets, HTTP/1.1 cleartext, lightest) or std (net/http, goroutine per stream; needed for https and h2)")
	fs.StringVar(&c.proto, "proto", "h1", "protocol for https targets (std engine): h1 or h2")
	fs.IntVar(&c.h2Conns, "h2-conns", 1, "h2: transports per target (each opens a new connection only when the server's stream limit is reached)")
	fs.IntVar(&c.workers, "workers", 1, "epoll engine: event loops (one keeps the tool's CPU lowest on a small box: bigger batches per epoll_wait)")
	fs.BoolVar(&c.uring, "uring", true, "epoll engine: read the streams one epoll_wait reports with one io_uring system call, where the kernel allows it (false: a read(2) each)")
	fs.StringVar(&c.src, "src", "127.0.0.2-127.0.0.255", "source addresses to spread connections over (IPv4 targets), low-high; empty for the kernel's choice")
	fs.IntVar(&c.inflight, "inflight", 1000, "ramp: most connection attempts in flight")
	fs.IntVar(&c.readBuf, "read-buf", 1024, "std engine: per-stream read buffer")

	fs.Float64Var(&c.rate, "rate", 0, "events/s to publish (default per scenario: fanout/scaleout 5, spread 500, reconnect 20)")
	fs.DurationVar(&c.duration, "duration", 0, "publishing (or churn) duration (default 30s; churn 10s)")
	fs.IntVar(&c.events, "events", 100, "reconnect: events published during the storm")
	fs.IntVar(&c.pad, "pad", 0, "bytes of padding in each event's data")
	fs.IntVar(&c.publishers, "publishers", 4, "publishing goroutines")
	fs.BoolVar(&c.ordered, "ordered", true, "publish each channel's events one after the other from one goroutine (strict order, but a slow publish delays the next); false: any free publisher takes the next event on schedule, like independent backends")
	fs.StringVar(&c.eventType, "event", "tick", "event type of published events")
	fs.BoolVar(&c.reconnect, "reconnect", true, "reconnect after a stream ends, with Last-Event-ID, like a browser (not in churn)")
	fs.Float64Var(&c.connRate, "conn-rate", 1000, "churn: new connections per second")
	fs.DurationVar(&c.hold, "hold", time.Second, "churn: how long each connection stays open")

	fs.DurationVar(&c.rampTimeout, "ramp-timeout", 60*time.Second, "time limit for opening the streams")
	fs.DurationVar(&c.settle, "settle", 0, "wait after the ramp before measuring (default: idle 5s, others 2s)")
	fs.DurationVar(&c.drain, "drain", 20*time.Second, "time limit for deliveries after the last publish")
	fs.DurationVar(&c.headTimeout, "head-timeout", 15*time.Second, "time limit for one connection attempt up to the response head")
	fs.DurationVar(&c.publishTimeout, "publish-timeout", 10*time.Second, "time limit for one publish request")
	fs.DurationVar(&c.reloadTimeout, "reload-timeout", 30*time.Second, "time limit for the reload request")
	fs.DurationVar(&c.waitTimeout, "wait-timeout", 60*time.Second, "reconnect: time limit for every client to have every event")
	fs.DurationVar(&c.totalTimeout, "timeout", 10*time.Minute, "hard limit for the whole run, plus -quiet-wait (the watchdog prints what it has and exits)")
	fs.DurationVar(&c.defaultRetry, "default-retry", 3*time.Second, "reconnection time before the server sent retry:")
	fs.DurationVar(&c.closeJitter, "close-jitter", 5*time.Second, "reconnect: the server's close_jitter (the target is close_jitter + 5s)")
	fs.DurationVar(&c.quietWait, "quiet-wait", 0, "before measuring, wait up to this long for the machine's other processes to use less than -quiet-cores (other agents' test runs skew the figures)")
	fs.Float64Var(&c.quietCores, "quiet-cores", 0.25, "CPU cores other processes may use for the machine to count as quiet; a measured window above it is noted as contended")
	fs.DurationVar(&c.idleHold, "idle-hold", 0, "idle: keep the streams open this long after measuring (to profile by hand)")

	fs.IntVar(&c.pid, "pid", 0, "server pid (default: the spawned servers, or the processes listening on the ports of the URLs and the publish URL, summed)")
	fs.Func("spawn", `start a server with this command line (split on spaces; leading NAME=value words are added to its environment), e.g. "/tmp/bench-caddy run --config cmd/ssebench/testdata/Caddyfile"; repeat for several servers (their RSS and CPU are summed, and reported per process); stopped (SIGTERM, then SIGKILL) at the end`, func(s string) error {
		if strings.TrimSpace(s) == "" {
			return errors.New("empty command line")
		}
		c.spawns = append(c.spawns, s)
		return nil
	})
	fs.StringVar(&c.spawnLog, "spawn-log", "", "the spawned server's output (default: a file in the temp dir; with several servers, the 2nd one's gets a .1 suffix and so on)")
	fs.DurationVar(&c.spawnWait, "spawn-wait", 30*time.Second, "time limit for the spawned servers (and Redis) to listen")
	fs.StringVar(&c.admin, "admin", "", "Caddy admin address (host:port) for reloads and pprof; comma-separated for several servers (the first one is reloaded and profiled, goroutines and memstats are summed over all)")
	fs.StringVar(&c.spawnRedis, "spawn-redis", "", "start a private Redis with this redis-server binary (a name is looked up in PATH) on a free 127.0.0.1 port, no persistence; its URL is given to the spawned servers in SSEBENCH_REDIS, its RSS and CPU are reported; stopped at the end")
	fs.IntVar(&c.redisPort, "redis-port", 0, "-spawn-redis: port (default: a free one; never 6379)")
	fs.StringVar(&c.publishRedis, "publish-redis", "", `publish straight into Redis with the module's function (FCALL sse_publish_v1, as a backend would) instead of the HTTP endpoint: a redis:// URL on loopback, or "spawned" for the -spawn-redis one`)
	fs.StringVar(&c.publishAs, "publish-as", "caddy-sse", "the publish API of the server measured: caddy-sse (its JSON POST), or another SSE server's for a side-by-side run: "+strings.Join(rivals, ", ")+" (see docs/PERFORMANCE.md; -url is then that server's subscribe URL with {ch}, -publish-url its publish URL, -secret its publisher key)")
	fs.StringVar(&c.redisPrefix, "redis-prefix", "sse:", "-publish-redis: the module's key prefix")
	fs.IntVar(&c.redisHistory, "redis-history", 1000, "-publish-redis: events kept per channel (the Caddyfile's history)")
	fs.StringVar(&c.chaos, "chaos", "", "fanout, spread, scaleout: faults while publishing, taken in turn every -chaos-every (comma-separated): "+strings.Join(chaosActions, ", ")+"; kill-redis and stop-redis touch only the -spawn-redis Redis (which then syncs its append-only file at every write), reload POSTs -config to each -admin in turn; 503s that offer an idempotency_key are retried under it")
	fs.DurationVar(&c.chaosEvery, "chaos-every", 20*time.Second, "-chaos: time between faults")
	fs.DurationVar(&c.chaosDown, "chaos-down", 2*time.Second, "-chaos: how long a killed Redis stays down, or a stopped one frozen")
	fs.IntVar(&c.procs, "procs", 0, "fanout, spread, scaleout: open the streams from this many child processes (each holds its share; process i uses URL i mod the URL count) while this one only publishes and merges; for more streams than one process may open files")
	fs.StringVar(&c.configPath, "config", "", "reconnect: config POSTed to the admin /load (a Caddyfile, or JSON if it ends in .json)")
	fs.StringVar(&c.reloadCmd, "reload-cmd", "", "reconnect: run this command line instead of POSTing to /load")

	fs.StringVar(&c.serverCPUProfile, "server-cpuprofile", "", "write the server's CPU profile (admin /debug/pprof/profile) over the measured window to this file")
	fs.StringVar(&c.serverHeapProfile, "server-heapprofile", "", "idle: write the server's heap profile (admin /debug/pprof/heap) after settling to this file")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write this tool's own CPU profile to this file")
	fs.StringVar(&c.out, "out", "", "also append the JSON line to this file")
	fs.StringVar(&c.label, "label", "", "free text copied into the JSON (e.g. the server build)")
	fs.BoolVar(&c.quiet, "q", false, "no progress lines")

	c.urlsFlag = &urls
}

// parseArgs parses `<scenario> [flags]` (or -scenario anywhere).
func parseArgs(args []string) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("ssebench", flag.ContinueOnError)
	fs.StringVar(&c.scenario, "scenario", "", "scenario: "+strings.Join(scenarios, ", "))
	c.flags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: ssebench <%s> [flags]\n\n", strings.Join(scenarios, "|"))
		fs.PrintDefaults()
	}
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		c.scenario = args[0]
		args = args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	c.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { c.set[f.Name] = true })
	c.splitLists()
	if err := c.defaults(); err != nil {
		return nil, err
	}
	return c, nil
}

// splitLists splits the comma-separated -url and -admin.
func (c *config) splitLists() {
	c.urls, c.admins = nil, nil
	for _, u := range strings.Split(*c.urlsFlag, ",") {
		if u = strings.TrimSpace(u); u != "" {
			c.urls = append(c.urls, u)
		}
	}
	for _, a := range strings.Split(c.admin, ",") {
		if a = strings.TrimSpace(a); a != "" {
			c.admins = append(c.admins, a)
		}
	}
	c.admin = ""
	if len(c.admins) > 0 {
		c.admin = c.admins[0]
	}
}

// defaults fills in per-scenario defaults and checks the flags.
func (c *config) defaults() error {
	def := func(name string, apply func()) {
		if !c.set[name] {
			apply()
		}
	}
	switch c.scenario {
	case "idle":
		def("channels", func() { c.channels = 1000 })
		def("settle", func() { c.settle = 5 * time.Second })
	case "fanout", "scaleout":
		def("channels", func() { c.channels = 1 })
		def("rate", func() { c.rate = 5 })
		def("duration", func() { c.duration = 30 * time.Second })
	case "spread":
		def("channels", func() { c.channels = 1000 })
		def("rate", func() { c.rate = 500 })
		def("duration", func() { c.duration = 30 * time.Second })
	case "reconnect":
		def("channels", func() { c.channels = 1 })
		def("rate", func() { c.rate = 20 })
	case "churn":
		def("channels", func() { c.channels = 100 })
		def("duration", func() { c.duration = 10 * time.Second })
		def("conns", func() { c.conns = 0 })
	case "":
		return fmt.Errorf("no scenario: want one of %s", strings.Join(scenarios, ", "))
	default:
		return fmt.Errorf("unknown scenario %q: want one of %s", c.scenario, strings.Join(scenarios, ", "))
	}
	def("settle", func() { c.settle = 2 * time.Second })
	switch {
	case len(c.urls) == 0:
		return fmt.Errorf("no -url")
	case c.scenario == "scaleout" && len(c.urls) < 2:
		return fmt.Errorf("scaleout needs several -url (comma-separated)")
	case c.channels < 1 || c.perConn < 1 || c.perConn > c.channels:
		return fmt.Errorf("-channels %d / -per-conn %d: want 1 ≤ per-conn ≤ channels", c.channels, c.perConn)
	case c.scenario != "churn" && c.conns < 1:
		return fmt.Errorf("-conns %d: want ≥ 1", c.conns)
	case c.engine != "epoll" && c.engine != "std":
		return fmt.Errorf("-engine %q: want epoll or std", c.engine)
	case c.proto != "h1" && c.proto != "h2":
		return fmt.Errorf("-proto %q: want h1 or h2", c.proto)
	case c.scenario == "reconnect" && c.configPath == "" && c.reloadCmd == "":
		return fmt.Errorf("reconnect needs -config (with -admin) or -reload-cmd to trigger the reload")
	case c.scenario == "reconnect" && c.configPath != "" && c.admin == "":
		return fmt.Errorf("reconnect with -config needs -admin")
	case (c.serverCPUProfile != "" || c.serverHeapProfile != "") && c.admin == "":
		return fmt.Errorf("server profiles need -admin")
	case c.scenario == "churn" && (c.connRate <= 0 || c.hold <= 0 || c.duration <= 0):
		return fmt.Errorf("churn needs -conn-rate, -hold and -duration > 0")
	case (c.scenario == "fanout" || c.scenario == "spread" || c.scenario == "scaleout") && (c.rate <= 0 || c.duration <= 0):
		return fmt.Errorf("-rate and -duration must be > 0")
	case c.procs < 0 || (c.procs > 0 && c.scenario != "fanout" && c.scenario != "spread" && c.scenario != "scaleout"):
		return fmt.Errorf("-procs %d: only fanout, spread and scaleout open their streams from child processes", c.procs)
	case c.procs > 0 && c.conns < c.procs:
		return fmt.Errorf("-procs %d: fewer -conns (%d) than processes", c.procs, c.conns)
	case c.redisPort != 0 && (c.spawnRedis == "" || c.redisPort < 1 || c.redisPort > 65535 || c.redisPort == 6379):
		return fmt.Errorf("-redis-port %d: needs -spawn-redis, and never 6379 (not ours)", c.redisPort)
	case c.publishRedis == "spawned" && c.spawnRedis == "":
		return fmt.Errorf("-publish-redis spawned needs -spawn-redis")
	case c.publishRedis != "" && c.publishURL != "":
		return fmt.Errorf("-publish-redis and -publish-url exclude each other")
	case c.publishAs != "caddy-sse" && !slices.Contains(rivals, c.publishAs):
		return fmt.Errorf("-publish-as %q: want caddy-sse or one of %s", c.publishAs, strings.Join(rivals, ", "))
	case c.publishAs != "caddy-sse" && (c.publishRedis != "" || c.scenario == "reconnect"):
		return fmt.Errorf("-publish-as %s: publishes through that server's API, without -publish-redis or the reconnect scenario (a Caddy reload)", c.publishAs)
	case c.publishRedis != "" && (c.redisHistory < 1 || c.redisPrefix == ""):
		return fmt.Errorf("-publish-redis needs -redis-history ≥ 1 and a -redis-prefix")
	}
	return c.checkChaos()
}

// phase is the current phase, for the watchdog's report.
var phase atomic.Value

func setPhase(p string) { phase.Store(p) }

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) > 0 && args[0] == "floor-server" {
		return runFloorServer(args[1:])
	}
	if len(args) > 0 && args[0] == "grip-backend" {
		return runGripBackend(args[1:])
	}
	if len(args) > 0 && args[0] == workerCommand {
		return runWorker(args[1:])
	}
	cfg, err := parseArgs(args)
	if err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		fmt.Fprintln(os.Stderr, "ssebench:", err)
		return 2
	}
	if cfg.cpuProfile != "" {
		f, err := os.Create(cfg.cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "ssebench:", err)
			return 2
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "ssebench:", err)
			return 2
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}
	r := newRunner(cfg, os.Stdout, os.Stderr)
	setPhase("setup")

	// The watchdog and signals: stop the spawned server, print what is
	// known, exit. Nothing can keep the tool running past -timeout.
	var once sync.Once
	abort := func(why string) {
		once.Do(func() {
			r.stopServer()
			p, _ := phase.Load().(string)
			out := map[string]any{"scenario": cfg.scenario, "ok": false, "partial": true, "error": why, "phase": p, "label": cfg.label}
			line, _ := json.Marshal(out)
			fmt.Println(string(line))
			r.appendOut(line)
			fmt.Fprintf(os.Stderr, "ssebench: %s (in phase %s)\n", why, p)
			os.Exit(3)
		})
	}
	limit := cfg.totalTimeout + cfg.quietWait
	watchdog := time.AfterFunc(limit, func() { abort(fmt.Sprintf("run exceeded -timeout %s (+ -quiet-wait)", cfg.totalTimeout)) })
	defer watchdog.Stop()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-sigs
		abort("interrupted by " + s.String())
	}()

	code := r.run()
	once.Do(func() {}) // the watchdog may no longer print
	return code
}
