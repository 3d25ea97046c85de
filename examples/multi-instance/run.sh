#!/usr/bin/env bash
# Two Caddy instances share one Redis: an event published on instance A
# reaches a subscriber on instance B, and a client that read some events
# from A reconnects to B with its Last-Event-ID and gets exactly the rest.
#
#   examples/multi-instance/run.sh
#
# Needs go, redis-server, redis-cli and curl. Ports can be changed with REDIS_PORT,
# A_PORT, B_PORT, A_ADMIN, B_ADMIN. Everything it starts is stopped at the
# end; it exits non-zero if delivery or resume does not work.
set -euo pipefail
cd "$(dirname "$0")/../.."

REDIS_PORT=${REDIS_PORT:-6391}
A_PORT=${A_PORT:-8081} B_PORT=${B_PORT:-8082}
A_ADMIN=${A_ADMIN:-2021} B_ADMIN=${B_ADMIN:-2022}
SECRET=demo-secret
work=$(mktemp -d)
pids=()
cleanup() {
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

say "building caddy with the sse module"
go build -o "$work/caddy" ./cmd/caddy

say "starting redis-server on :$REDIS_PORT"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)

start_caddy() { # name port admin
	SSE_PORT=$2 ADMIN_PORT=$3 REDIS_URL=redis://127.0.0.1:$REDIS_PORT SSE_PUBLISH_SECRET=$SECRET \
		HOME="$work" XDG_DATA_HOME="$work/data" XDG_CONFIG_HOME="$work/config" \
		"$work/caddy" run --config examples/multi-instance/Caddyfile >"$work/$1.log" 2>&1 &
	pids+=($!)
}
say "starting instance A on :$A_PORT and instance B on :$B_PORT"
start_caddy a "$A_PORT" "$A_ADMIN"
start_caddy b "$B_PORT" "$B_ADMIN"
# wait until both answer (a busy machine may need a while); say why if not
for inst in "a $A_ADMIN $A_PORT" "b $B_ADMIN $B_PORT"; do
	set -- $inst
	up=
	for _ in $(seq 600); do
		if curl -sf "http://127.0.0.1:$2/config/" >/dev/null && curl -s -o /dev/null "http://127.0.0.1:$3/"; then up=1; break; fi
		sleep 0.1
	done
	[ -n "$up" ] || { cat "$work/$1.log" >&2; fail "instance $1 did not start within 60 s"; }
done
redis-cli -p "$REDIS_PORT" ping >/dev/null || fail "redis did not start"

publish() { # port data -> the event's id
	curl -sf -H "Authorization: Bearer $SECRET" -H 'Content-Type: application/json' \
		-d "{\"channel\":\"orders\",\"data\":\"$2\"}" "http://127.0.0.1:$1/events" |
		sed -E 's/.*"orders":"([^"]+)".*/\1/'
}
wait_for() { # file text
	for _ in $(seq 100); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
	fail "$2 did not arrive in $1"
}

say "1. a subscriber on B, events published on A"
curl -sN "http://127.0.0.1:$B_PORT/events?channels=orders" >"$work/sub-b.txt" &
pids+=($!)
wait_for "$work/sub-b.txt" ": ok" # the stream is live (B follows the channel in Redis) once it says ok
for n in 1 2 3; do publish "$A_PORT" "order-$n" >/dev/null; done
wait_for "$work/sub-b.txt" "order-3"
cat "$work/sub-b.txt"

say "2. a client reads from A, leaves, and resumes on B with its Last-Event-ID"
curl -sN "http://127.0.0.1:$A_PORT/events?channels=orders" >"$work/sub-a.txt" &
client=$!
wait_for "$work/sub-a.txt" ": ok"
publish "$A_PORT" "order-4" >/dev/null
wait_for "$work/sub-a.txt" "order-4"
kill "$client"
last_id=$(grep '^id: ' "$work/sub-a.txt" | tail -1 | cut -c5-)
echo "the client saw order-4 (id $last_id) and disconnected"
publish "$B_PORT" "order-5" >/dev/null
publish "$A_PORT" "order-6" >/dev/null
echo "order-5 and order-6 were published while it was away"
curl -sN -H "Last-Event-ID: $last_id" "http://127.0.0.1:$B_PORT/events?channels=orders" >"$work/resumed.txt" &
pids+=($!)
wait_for "$work/resumed.txt" "order-6"
cat "$work/resumed.txt"
got=$(grep '^data: ' "$work/resumed.txt" | cut -c7- | tr '\n' ' ')
[ "$got" = "order-5 order-6 " ] || fail "resumed on B with '$got', want 'order-5 order-6'"
grep -q 'sse_truncated' "$work/resumed.txt" && fail "the resume was truncated"

say "OK: cross-instance delivery and resume work"
