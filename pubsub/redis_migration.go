package pubsub

// Publishing while a Redis Cluster slot migrates (a reshard).

import (
	"context"
	"strings"
	"time"
)

// publishWhileMigrating publishes without the token when the call with it
// was refused because the channel's slot is migrating: Redis then runs no
// command whose keys are not all on one node (TRYAGAIN), and the token's
// key never exists before the call. The channel's own keys are on one node
// but for the moment MIGRATE moves them, and a redirect may come back
// while it does (ASK): neither ran anything, so the publish is tried again,
// a few times.
//
// A keyed publish (Once, or TokenRequired: an Idempotency-Key's, or one of
// a request to several channels) keeps its token, and waits for the slot's
// keys to move for a little longer: without the token, the retry of its
// request under its key would publish the event a second time. If they
// are still moving it fails (503), and its request is retried.
func (b *Redis) publishWhileMigrating(ctx context.Context, key string, args []any, keyed bool, reply any, err error) (any, error) {
	function, attempts := FunctionPublishCounted, keyedMigrationAttempts
	if !keyed {
		function, args = withoutToken(args)
		attempts = 4
	}
	var pause migrationPause
	for range attempts {
		if !isTryAgain(err) && !isMoved(err) {
			break
		}
		reply, err = b.call(ctx, key, function, args...)
		if (isTryAgain(err) || isMoved(err)) && !pause.wait(ctx) {
			return reply, err
		}
	}
	return reply, err
}

// keyedMigrationAttempts is how many times a keyed publish is tried again
// while its slot migrates: 5 ms to 640 ms apart, 1.3 s of pauses (about 2 s
// in all with go-redis' own retries of a TRYAGAIN).
const keyedMigrationAttempts = 8

// migrationPause spaces the attempts of a publish while its slot migrates:
// 5 ms, then twice as long each time (the keys of one slot move in
// milliseconds).
type migrationPause struct{ last time.Duration }

// wait pauses for the next interval; false if ctx ended first.
func (p *migrationPause) wait(ctx context.Context) bool {
	p.last = max(2*p.last, 5*time.Millisecond)
	select {
	case <-time.After(p.last):
		return true
	case <-ctx.Done():
		return false
	}
}

// isTryAgain reports whether Redis refused a call because its keys are
// split between two nodes by a slot migration (TRYAGAIN).
func isTryAgain(err error) bool {
	return err != nil && strings.Contains(err.Error(), "TRYAGAIN")
}

// movedTo reports whether err redirects a command to another node (MOVED,
// or ASK while a slot migrates), and that node's address.
func movedTo(err error) (string, bool) {
	if !isMoved(err) {
		return "", false
	}
	fields := strings.Fields(err.Error())
	return fields[len(fields)-1], true
}
