# Load benchmarks of the sse handler: see docs/PERFORMANCE.md ("Load
# benchmarks"). Every target builds the server (./cmd/caddy) and the load tool
# (./cmd/ssebench), lets the tool start the server (-spawn) on
# cmd/ssebench/testdata/Caddyfile and stop it at the end (by its pid), prints a
# summary and appends one JSON line per run to $(BENCH_OUT). Loopback only.
# Run one at a time: the server and the load share the box. The bench-redis-*
# targets and bench-scaleout also start a private redis-server (-spawn-redis,
# a free port, never 6379) and run Caddy on cmd/ssebench/testdata/Caddyfile.redis.
# SSEBENCH_WRITER (net_http or takeover), in the environment or on the make
# command line, reaches the servers (the Caddyfiles read it).

GO            ?= go
BENCH_CADDY   ?= /tmp/bench-caddy
BENCH_TOOL    ?= /tmp/ssebench
BENCH_OUT     ?= /tmp/ssebench-results.jsonl
BENCH_PROFILES ?= /tmp/ssebench-profiles
BENCH_CONFIG  ?= cmd/ssebench/testdata/Caddyfile
BENCH_TLS_CONFIG ?= cmd/ssebench/testdata/Caddyfile.tls
BENCH_ADMIN   ?= 127.0.0.1:9019
BENCH_URL     ?= http://127.0.0.1:9080/events
BENCH_URL2    ?= http://127.0.0.1:9081/events
BENCH_TLS_URL ?= https://127.0.0.1:9443/events
BENCH_CONNS   ?= 10000
BENCH_FLAGS   ?=
BENCH_QUIET   ?= -quiet-wait 5m
BENCH_REDIS_CONFIG ?= cmd/ssebench/testdata/Caddyfile.redis
BENCH_REDIS_SERVER ?= redis-server
BENCH_SCALEOUT_CONNS ?= 45000
BENCH_SCALEOUT_URLS  ?= http://127.0.0.1:9080/events,http://127.0.0.1:9180/events,http://127.0.0.1:9280/events

SSEBENCH = $(BENCH_TOOL)
SPAWN    = -spawn "$(BENCH_CADDY) run --config $(BENCH_CONFIG)" -admin $(BENCH_ADMIN) -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)
SPAWN_TLS = -spawn "$(BENCH_CADDY) run --config $(BENCH_TLS_CONFIG)" -admin $(BENCH_ADMIN) -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)
# one Caddy on a spawned Redis
SPAWN_REDIS = -spawn-redis $(BENCH_REDIS_SERVER) -spawn "$(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" -admin $(BENCH_ADMIN) -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)
# three Caddy processes on one spawned Redis (ports 9080/9081 admin 9019, 9180/9181 admin 9119, 9280/9281 admin 9219)
SPAWN_SCALEOUT = -spawn-redis $(BENCH_REDIS_SERVER) \
	-spawn "SSEBENCH_PORT=9080 SSEBENCH_PORT2=9081 SSEBENCH_ADMIN=9019 $(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" \
	-spawn "SSEBENCH_PORT=9180 SSEBENCH_PORT2=9181 SSEBENCH_ADMIN=9119 $(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" \
	-spawn "SSEBENCH_PORT=9280 SSEBENCH_PORT2=9281 SSEBENCH_ADMIN=9219 $(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" \
	-admin 127.0.0.1:9019,127.0.0.1:9119,127.0.0.1:9219 -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)

# two Caddy processes on one spawned Redis, for bench-redis-chaos
SPAWN_CHAOS = -spawn-redis $(BENCH_REDIS_SERVER) \
	-spawn "SSEBENCH_PORT=9080 SSEBENCH_PORT2=9081 SSEBENCH_ADMIN=9019 $(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" \
	-spawn "SSEBENCH_PORT=9180 SSEBENCH_PORT2=9181 SSEBENCH_ADMIN=9119 $(BENCH_CADDY) run --config $(BENCH_REDIS_CONFIG)" \
	-admin 127.0.0.1:9019,127.0.0.1:9119 -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)

## test: the whole suite with the race detector, and the in-process and
## built-binary tests again with the takeover writer, with and without
## io_uring (every test passes with either writer). This is the README's test
## command; .ci/run runs it. The runs are processes of their own whose tests
## take free ports and temporary directories, and mostly wait (for Redis,
## timeouts, clients): they run in two lanes side by side, each lane's output
## printed whole when it ends. The root package's run without io_uring is
## split between the lanes (TAKEOVER_HALF's tests in one, the others in the
## other: -run and -skip of one pattern, so every test runs once), which
## evens them out: the lane of the takeover runs took as long as the other
## and one whole run more. (All three side by side was a minute faster on two
## cores than two lanes unsplit, and loaded the box enough to show a test's
## race with it in one run out of two.)
.PHONY: test test-all test-takeover test-lane-all test-lane-takeover
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-lane-all test-lane-takeover

TEST_RACE      = $(GO) test -race -count=1 -timeout 15m
TAKEOVER       = SSE_TEST_WRITER=takeover
TAKEOVER_NOURING = CADDY_SSE_IO_URING=0 SSE_TEST_WRITER=takeover
# about half of the root package's test time (TestRedis* is a third of it)
TAKEOVER_HALF  = ^Test([A-Q]|Redis[A-M])

## test-all: the whole suite once, with the default writer
test-all:
	$(TEST_RACE) ./...

## test-takeover: the root package and the built-binary tests with the
## takeover writer, then the root package again without io_uring
test-takeover:
	$(TAKEOVER) $(TEST_RACE) . ./e2e/
	$(TAKEOVER_NOURING) $(TEST_RACE) .

test-lane-all: test-all
	$(TAKEOVER_NOURING) $(TEST_RACE) -run '$(TAKEOVER_HALF)' .

test-lane-takeover:
	$(TAKEOVER) $(TEST_RACE) . ./e2e/
	$(TAKEOVER_NOURING) $(TEST_RACE) -skip '$(TAKEOVER_HALF)' .

.PHONY: bench-caddy-floor
.PHONY: bench bench-build bench-idle bench-fanout bench-fanout20 bench-fanout30 bench-spread bench-ramp bench-churn \
	bench-reconnect bench-scaleout bench-idle-tls bench-idle-h2 bench-floor bench-profile-fanout bench-profile-fanout20 \
	bench-profile-idle bench-profile-churn bench-redis bench-redis-idle bench-redis-fanout bench-redis-fanout20 \
	bench-redis-spread bench-redis-spread-direct bench-redis-ramp bench-redis-reconnect \
	bench-redis-fanout-direct bench-redis-chaos

## bench: every scenario of the performance issue (about 8 minutes on a quiet machine)
bench: bench-idle bench-fanout bench-fanout20 bench-fanout30 bench-spread bench-ramp bench-churn bench-reconnect bench-scaleout

## bench-build: BENCH_NOBUILD=1 keeps an existing $(BENCH_CADDY) (e.g. a build of another commit)
bench-build:
	@if [ -z "$(BENCH_NOBUILD)" ]; then set -x; $(GO) build -o $(BENCH_CADDY) ./cmd/caddy; fi
	$(GO) build -o $(BENCH_TOOL) ./cmd/ssebench

## idle: 10k streams over 1000 channels; server RSS delta per stream
bench-idle: bench-build
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 $(SPAWN)

## fanout: 10k subscribers of one channel, 5 events/s for 30 s (50k deliveries/s)
bench-fanout: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 5 -duration 30s $(SPAWN)

## fanout20: the same at 20 events/s (200k deliveries/s offered; saturates the box). Publishers do not wait
## for each other (-ordered=false): one sequential publisher is slowed by the loaded server and cannot offer 20/s
bench-fanout20: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 20 -duration 30s -drain 60s -ordered=false -publishers 16 $(SPAWN)

## fanout30: 300k deliveries/s offered, to see past the 220k/s target
bench-fanout30: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 30 -duration 30s -drain 60s -ordered=false -publishers 16 $(SPAWN)

## spread: 10k subscribers over 1000 channels, 500 events/s
bench-spread: bench-build
	$(SSEBENCH) spread -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -rate 500 -duration 30s $(SPAWN)

## ramp: how fast 10k streams open (no settle, nothing else)
bench-ramp: bench-build
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -settle 0 $(SPAWN)

## churn: 5000 new streams/s, each open 1 s, for 10 s
bench-churn: bench-build
	$(SSEBENCH) churn -url $(BENCH_URL) -conn-rate 5000 -hold 1s -duration 10s $(SPAWN)

## reconnect: 10k streams, a forced reload (POST /load), 100 events meanwhile
bench-reconnect: bench-build
	$(SSEBENCH) reconnect -url $(BENCH_URL) -conns $(BENCH_CONNS) -events 100 -rate 20 -config $(BENCH_CONFIG) -close-jitter 5s $(SPAWN)

## scaleout: three Caddy processes sharing one Redis, 15k subscribers each (45k streams of one channel, opened by
## three subscriber processes: one process may open at most 20k files), 5 events/s published to the first for 30 s
bench-scaleout: bench-build
	$(SSEBENCH) scaleout -url $(BENCH_SCALEOUT_URLS) -conns $(BENCH_SCALEOUT_CONNS) -procs 3 -rate 5 -duration 30s -ramp-timeout 3m $(SPAWN_SCALEOUT)

## redis: the scenarios above with one Caddy on a spawned Redis (Caddyfile.redis), and bench-scaleout
bench-redis: bench-redis-idle bench-redis-fanout bench-redis-fanout20 bench-redis-spread bench-redis-spread-direct bench-redis-ramp \
	bench-redis-reconnect bench-scaleout

bench-redis-idle: bench-build
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 $(SPAWN_REDIS)

bench-redis-fanout: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 5 -duration 30s $(SPAWN_REDIS)

bench-redis-fanout20: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 20 -duration 30s -drain 60s -ordered=false -publishers 16 $(SPAWN_REDIS)

bench-redis-spread: bench-build
	$(SSEBENCH) spread -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -rate 500 -duration 30s $(SPAWN_REDIS)

## redis-spread-direct: bench-redis-spread with the events published straight into Redis, as a backend would
bench-redis-spread-direct: bench-build
	$(SSEBENCH) spread -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -rate 500 -duration 30s -publish-redis spawned $(SPAWN_REDIS)

## redis-ramp: bench-ramp with one Caddy on a spawned Redis
bench-redis-ramp: bench-build
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -settle 0 $(SPAWN_REDIS)

bench-redis-reconnect: bench-build
	$(SSEBENCH) reconnect -url $(BENCH_URL) -conns $(BENCH_CONNS) -events 100 -rate 20 -config $(BENCH_REDIS_CONFIG) -close-jitter 5s $(SPAWN_REDIS)

## redis-chaos: faults while publishing (not a performance figure): two Caddy processes on a spawned Redis,
## 2000 streams over 20 channels, 20 events/s for 150 s through the first; every 8 s in turn Redis is killed (its
## append-only file synced at every write) and started again 2 s later, frozen for 2 s, one Caddy reloaded, or the
## second Caddy killed and started again 2 s later. Every accepted event must arrive once and in order; a 503 is
## retried under the idempotency_key it offers
bench-redis-chaos: bench-build
	$(SSEBENCH) scaleout -url http://127.0.0.1:9080/events,http://127.0.0.1:9180/events -conns 2000 -procs 2 -channels 20 \
		-rate 20 -duration 150s -drain 60s -chaos kill-redis,stop-redis,reload,kill-server -chaos-every 8s -chaos-down 2s \
		-config $(BENCH_REDIS_CONFIG) $(SPAWN_CHAOS)

## redis-fanout-direct: bench-redis-fanout with the events published straight into Redis (FCALL sse_publish_v1, as a
## backend would) instead of through Caddy's HTTP endpoint
bench-redis-fanout-direct: bench-build
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 5 -duration 30s -publish-redis spawned $(SPAWN_REDIS)

## idle-tls / idle-h2: idle memory of TLS HTTP/1.1 and HTTP/2 streams (goroutine engine)
bench-idle-tls: bench-build
	$(SSEBENCH) idle -url $(BENCH_TLS_URL) -engine std -proto h1 -conns $(BENCH_CONNS) -channels 1000 $(SPAWN_TLS)

bench-idle-h2: bench-build
	$(SSEBENCH) idle -url $(BENCH_TLS_URL) -engine std -proto h2 -h2-conns 40 -conns $(BENCH_CONNS) -channels 1000 $(SPAWN_TLS)

## floor: the same fanout and spread against `ssebench floor-server -uring`, a bare reference server (one send per
## delivery, an event's sends in one io_uring submission as the module's loops do, nothing else): what the kernel's
## loopback TCP and the load generator cost on this machine
bench-floor: bench-build
	$(SSEBENCH) fanout -url http://127.0.0.1:9090/events -conns $(BENCH_CONNS) -rate 5 -duration 30s -spawn "$(BENCH_TOOL) floor-server -addr 127.0.0.1:9090 -uring" -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)
	$(SSEBENCH) spread -url http://127.0.0.1:9090/events -conns $(BENCH_CONNS) -channels 1000 -rate 500 -duration 30s -spawn "$(BENCH_TOOL) floor-server -addr 127.0.0.1:9090 -uring" -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)

## caddy-floor: the connection ramp of Caddy itself: cmd/caddyfloor's sse_floor handler writes a stream's headers
## and opening comment and takes the connection over (no checks, channel or event loop), on the same site as
## bench-ramp; what is left of a stream's start cost when the sse handler costs nothing
BENCH_FLOOR_CADDY ?= /tmp/bench-caddyfloor
bench-caddy-floor: bench-build
	$(GO) build -o $(BENCH_FLOOR_CADDY) ./cmd/caddyfloor
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -settle 0 -label caddy-floor \
		-spawn "$(BENCH_FLOOR_CADDY) run --config cmd/ssebench/testdata/Caddyfile.floor" -admin $(BENCH_ADMIN) -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)

## profiles (admin /debug/pprof) into $(BENCH_PROFILES); read with go tool pprof -top $(BENCH_CADDY) <file>
bench-profile-fanout: bench-build
	mkdir -p $(BENCH_PROFILES)
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 5 -duration 30s -server-cpuprofile $(BENCH_PROFILES)/fanout5-cpu.pprof $(SPAWN)

bench-profile-fanout20: bench-build
	mkdir -p $(BENCH_PROFILES)
	$(SSEBENCH) fanout -url $(BENCH_URL) -conns $(BENCH_CONNS) -rate 20 -duration 30s -drain 60s -ordered=false -publishers 16 -server-cpuprofile $(BENCH_PROFILES)/fanout20-cpu.pprof $(SPAWN)

bench-profile-churn: bench-build
	mkdir -p $(BENCH_PROFILES)
	$(SSEBENCH) churn -url $(BENCH_URL) -conn-rate 5000 -hold 1s -duration 10s -server-cpuprofile $(BENCH_PROFILES)/churn-cpu.pprof $(SPAWN)

bench-profile-idle: bench-build
	mkdir -p $(BENCH_PROFILES)
	$(SSEBENCH) idle -url $(BENCH_URL) -conns $(BENCH_CONNS) -channels 1000 -server-heapprofile $(BENCH_PROFILES)/idle-heap.pprof $(SPAWN)

## Side by side: the issue's reference servers, measured with the same tool and scenarios on this machine
## (docs/PERFORMANCE.md, "Side by side"). bench-rivals-build installs Nchan (Debian's nginx-light and
## libnginx-mod-nchan) and Pushpin (Debian's pushpin) and builds Mercure v0.24.0 (a Caddy module, with xcaddy and
## the same Caddy) and Centrifugo v6.9.1 into $(RIVALS_DIR); none of it is needed by the tests or committed. The
## module proxy here serves those versions without checksum-database entries: GOSUMDB=off for these two builds.
## Each bench-rival-<server> runs idle, fanout (5/s), fanout20 and spread against it; the -redis ones fan out
## through a Redis the tool starts on port 6391 (the servers' configs name it).
RIVALS_DIR      ?= /tmp/ssebench-rivals
RIVALS_CONF     = $(CURDIR)/cmd/ssebench/testdata/rivals
MERCURE_VERSION ?= v0.24.0
CENTRIFUGO_VERSION ?= v6.9.1
RIVAL_OUT       = -out $(BENCH_OUT) $(BENCH_QUIET) $(BENCH_FLAGS)
RIVAL_REDIS     = -spawn-redis $(BENCH_REDIS_SERVER) -redis-port 6391
RIVAL_NCHAN     = -url 'http://127.0.0.1:9080/sub/{ch}' -publish-url 'http://127.0.0.1:9080/pub/{ch}' -publish-as nchan $(RIVAL_OUT)
RIVAL_MERCURE   = -url 'http://127.0.0.1:9080/.well-known/mercure?topic={ch}' -publish-as mercure -secret bench $(RIVAL_OUT) \
	-spawn "$(RIVALS_DIR)/mercure-caddy run --config $(RIVALS_CONF)/Caddyfile.mercure"
RIVAL_CENTRIFUGO = -url 'http://127.0.0.1:9080/connection/uni_sse?cf_connect=%7B%22subs%22%3A%7B%22{ch}%22%3A%7B%7D%7D%7D' \
	-publish-url http://127.0.0.1:9080/api/publish -publish-as centrifugo -secret bench $(RIVAL_OUT)
# Pushpin's proxy drops streams (502, "message out of sequence") when 100 or more open at once: 20 in flight
RIVAL_PUSHPIN   = -url 'http://127.0.0.1:9080/stream/{ch}' -publish-url http://127.0.0.1:5561/publish/ -publish-as pushpin $(RIVAL_OUT) \
	-inflight 20 -spawn "$(BENCH_TOOL) grip-backend -addr 127.0.0.1:9098" -spawn "pushpin --config $(RIVALS_CONF)/pushpin.conf"
# the four scenarios, as bench-idle, bench-fanout, bench-fanout20 and bench-spread
RIVAL_SCENARIOS = "idle -conns $(BENCH_CONNS) -channels 1000" \
	"fanout -conns $(BENCH_CONNS) -rate 5 -duration 30s" \
	"fanout -conns $(BENCH_CONNS) -rate 20 -duration 30s -drain 60s -ordered=false -publishers 16" \
	"spread -conns $(BENCH_CONNS) -channels 1000 -rate 500 -duration 30s"

.PHONY: bench-rivals bench-rivals-build bench-rival-caddy-sse bench-rival-caddy-sse-redis bench-rival-nchan bench-rival-nchan-redis bench-rival-mercure \
	bench-rival-centrifugo bench-rival-centrifugo-redis bench-rival-pushpin

bench-rivals: bench-rival-caddy-sse bench-rival-caddy-sse-redis bench-rival-nchan bench-rival-nchan-redis \
	bench-rival-mercure bench-rival-centrifugo bench-rival-centrifugo-redis bench-rival-pushpin

bench-rivals-build: bench-build
	@if ! command -v nginx >/dev/null || [ ! -e /usr/lib/nginx/modules/ngx_nchan_module.so ] || ! command -v pushpin >/dev/null; then \
		set -x; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light libnginx-mod-nchan pushpin; fi
	mkdir -p $(RIVALS_DIR)/nchan/tmp $(RIVALS_DIR)/pushpin
	@if [ ! -x $(RIVALS_DIR)/mercure-caddy ]; then set -x; cd $(RIVALS_DIR) && GOSUMDB=off CADDY_VERSION=v2.11.9 \
		$(GO) run github.com/caddyserver/xcaddy/cmd/xcaddy@v0.4.5 build \
		--with github.com/dunglas/mercure/caddy@$(MERCURE_VERSION) --output $(RIVALS_DIR)/mercure-caddy; fi
	@if [ ! -x $(RIVALS_DIR)/centrifugo ]; then set -x; GOSUMDB=off GOBIN=$(RIVALS_DIR) \
		$(GO) install github.com/centrifugal/centrifugo/v6@$(CENTRIFUGO_VERSION); fi

# run-rival runs the four scenarios with the server's flags ($(1)); a failed run (lost events, streams that did
# not open) does not stop the others, and fails the target at the end
define run-rival
	failed=0; for sc in $(RIVAL_SCENARIOS); do $(SSEBENCH) $$sc $(1) || failed=1; done; exit $$failed
endef

## the module itself through the same loop, for a side-by-side pass: the takeover writer unless SSEBENCH_WRITER
## says otherwise; the -redis one on a Redis of its own (Caddyfile.redis)
bench-rival-caddy-sse: bench-build
	export SSEBENCH_WRITER=$${SSEBENCH_WRITER:-takeover}; $(call run-rival,-label caddy-sse-$$SSEBENCH_WRITER -url $(BENCH_URL) $(SPAWN))

bench-rival-caddy-sse-redis: bench-build
	export SSEBENCH_WRITER=$${SSEBENCH_WRITER:-takeover}; $(call run-rival,-label caddy-sse-redis-$$SSEBENCH_WRITER -url $(BENCH_URL) $(SPAWN_REDIS))

bench-rival-nchan: bench-rivals-build
	$(call run-rival,-label nchan $(RIVAL_NCHAN) -spawn "nginx -p $(RIVALS_DIR)/nchan -c $(RIVALS_CONF)/nchan.conf")

bench-rival-nchan-redis: bench-rivals-build
	$(call run-rival,-label nchan-redis $(RIVAL_NCHAN) $(RIVAL_REDIS) -spawn "nginx -p $(RIVALS_DIR)/nchan -c $(RIVALS_CONF)/nchan-redis.conf")

bench-rival-mercure: bench-rivals-build
	$(call run-rival,-label mercure $(RIVAL_MERCURE))

bench-rival-centrifugo: bench-rivals-build
	$(call run-rival,-label centrifugo $(RIVAL_CENTRIFUGO) -spawn "$(RIVALS_DIR)/centrifugo -c $(RIVALS_CONF)/centrifugo.json")

bench-rival-centrifugo-redis: bench-rivals-build
	$(call run-rival,-label centrifugo-redis $(RIVAL_CENTRIFUGO) $(RIVAL_REDIS) -spawn "$(RIVALS_DIR)/centrifugo -c $(RIVALS_CONF)/centrifugo-redis.json")

bench-rival-pushpin: bench-rivals-build
	rm -rf $(RIVALS_DIR)/pushpin/run $(RIVALS_DIR)/pushpin/log && mkdir -p $(RIVALS_DIR)/pushpin/run $(RIVALS_DIR)/pushpin/log
	$(call run-rival,-label pushpin $(RIVAL_PUSHPIN))
