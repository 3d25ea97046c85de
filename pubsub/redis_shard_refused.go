package pubsub

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
)

// A Redis ACL may grant the user only some of the prefix's shard channels
// (&sse:{public:*}). Redis refuses an SSUBSCRIBE of several channels as a
// whole when it denies one of them, with a NOPERM that names none, so one
// client asking for a denied channel would keep every channel of the
// primary from its live events. The shard therefore tells which command a
// refusal answers (Redis answers a connection's commands in order: sent
// lists those awaiting replies), subscribes the keys of a refused command
// of several one by one from then on, and holds as refused only the keys
// whose own command Redis refused: their streams are treated as SPEC S9
// has them while Redis cannot deliver (redis_denied.go), the others go on.
// Refused keys are asked again every refusedRetry, a few at a time, and all
// the sooner once Redis accepts one (the ACL changed).

// subscribeCmd is an SSUBSCRIBE (or, leaving, an SUNSUBSCRIBE) sent on
// the connection: its keys, and how many of their confirmations have not
// come yet. Unsubscribes are noted too: Redis answers one whose slot moved
// with a MOVED, which would otherwise be taken for a subscription's.
type subscribeCmd struct {
	keys    []string
	left    int
	leaving bool
}

// refusedRetry is how often the keys Redis refused are asked again.
const refusedRetry = 2 * time.Second

// refusedRetryBatch is how many refused keys one retry asks for: a user
// refused SSUBSCRIBE altogether would otherwise send every key every
// refusedRetry.
const refusedRetryBatch = 16

// subscribeBatches splits keys into SSUBSCRIBE commands: one per hash
// slot on a cluster (slotBatches), one per key once a command of several
// was refused (oneByOne).
func (s *shard) subscribeBatches(keys []string) [][]string {
	s.mu.Lock()
	oneByOne := s.oneByOne
	s.mu.Unlock()
	if !oneByOne {
		return s.slotBatches(keys)
	}
	batches := make([][]string, len(keys))
	for i, key := range keys {
		batches[i] = []string{key}
	}
	return batches
}

// sendSubscribe sends one SSUBSCRIBE of keys on ps, noted in sent
// (noteSentLocked).
func (s *shard) sendSubscribe(ctx context.Context, ps *redis.PubSub, keys []string) error {
	s.mu.Lock()
	s.noteSentLocked(ps, keys, false)
	for _, key := range keys {
		if _, ok := s.refused[key]; ok {
			s.refused[key] = true // in flight
		}
	}
	s.mu.Unlock()
	return ps.SSubscribe(ctx, keys...)
}

// noteSentLocked notes a command about to go on ps, in the order it goes
// on the wire (sendMu). A send on a connection replaced meanwhile is not
// noted: its replies never reach the new one's receive.
func (s *shard) noteSentLocked(ps *redis.PubSub, keys []string, leaving bool) {
	if ps == s.ps {
		s.sent = append(s.sent, subscribeCmd{keys: keys, left: len(keys), leaving: leaving})
	}
}

// repliedLocked takes one key's confirmation from the oldest command
// awaiting replies: Redis answers commands in order, and a command of n
// keys with n confirmations.
func (s *shard) repliedLocked() {
	if len(s.sent) > 0 {
		if s.sent[0].left--; s.sent[0].left <= 0 {
			s.sent = s.sent[1:]
		}
	}
}

// confirmedLocked takes the confirmation of key's subscription from the
// oldest command awaiting replies, and ends a refusal of key. It reports
// whether key was refused until now.
func (s *shard) confirmedLocked(key string) (wasRefused bool) {
	s.repliedLocked()
	if _, wasRefused = s.refused[key]; wasRefused {
		delete(s.refused, key)
		if wt := s.keys[key]; wt != nil {
			wt.denied.Store(s.denied != nil)
		}
		s.nextRetry = time.Time{} // the ACL may grant the others too: ask now
	}
	return wasRefused
}

// answeredLocked takes the oldest command awaiting replies off sent: an
// error reply answers a command as a whole, and none of its keys'
// confirmations will come. False if none was awaiting replies.
func (s *shard) answeredLocked() (subscribeCmd, bool) {
	if len(s.sent) == 0 {
		return subscribeCmd{}, false
	}
	cmd := s.sent[0]
	s.sent = s.sent[1:]
	if !cmd.leaving {
		s.unconfirmed -= cmd.left
		return cmd, true
	}
	for _, key := range cmd.keys {
		s.leftLocked(key) // no unsubscribe of it is to be confirmed now
	}
	return cmd, true
}

// redirectedOldest takes a MOVED (or ASK) naming slot as the answer to
// the oldest command awaiting replies, as refuseOldest takes a NOPERM:
// left in sent, it would take the next command's confirmation, and a later
// refusal would be held against a key Redis accepted. A command of another
// slot is not the one redirected (each carries the keys of one slot): the
// MOVED answers an unsubscribe already taken off, whose key's unsubscribe
// Redis sent itself when it gave the slot up (unsubscribedLocked).
func (s *shard) redirectedOldest(slot int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sent) > 0 && len(s.sent[0].keys) > 0 && slot >= 0 && int(clusterslot.Of(s.sent[0].keys[0])) != slot {
		return
	}
	s.answeredLocked()
}

// unsubscribedLocked takes an unsubscribe of key that Redis sent: true if
// it is the reply to one this instance sent, false if it is Redis giving
// the slot up. A reply comes while that unsubscribe is the oldest command
// awaiting replies. Redis' own may come while one is awaited too: the
// unsubscribe reaches Redis after the slot moved, and a MOVED answers it
// (redirectedOldest), which taken for its reply here took the next
// command's answer for the unsubscribe's, and so on down the queue. When
// the unsubscribe is the oldest command the two cannot be told apart: the
// MOVED that follows then names a slot the next command is not of.
func (s *shard) unsubscribedLocked(key string) bool {
	if len(s.sent) == 0 || !s.sent[0].leaving || !slices.Contains(s.sent[0].keys, key) || !s.leftLocked(key) {
		return false
	}
	s.repliedLocked()
	return true
}

// refuseOldest takes a NOPERM as the refusal of the oldest command
// awaiting replies: its key is refused if it had one, and its keys are
// subscribed again one by one if it had several. False if no command was
// awaiting replies (the refusal is of something else).
func (s *shard) refuseOldest(ctx context.Context, ps *redis.PubSub, err error) bool {
	s.mu.Lock()
	cmd, ok := s.answeredLocked()
	if !ok {
		s.mu.Unlock()
		return false
	}
	if cmd.leaving {
		// a user refused SUNSUBSCRIBE: the channel stays subscribed in
		// Redis, and its messages are dropped here (ACL LOG shows it)
		s.mu.Unlock()
		return true
	}
	var again []string
	refusedOne := false
	if len(cmd.keys) > 1 {
		s.oneByOne = true
		for _, key := range cmd.keys {
			if _, carried := s.keys[key]; carried {
				again = append(again, key)
			}
		}
		s.awaitLocked(len(again))
	} else if wt := s.keys[cmd.keys[0]]; wt != nil {
		if s.refused == nil {
			s.refused = make(map[string]bool)
		}
		s.refused[cmd.keys[0]] = false
		wt.denied.Store(true)
		refusedOne = true
	}
	s.mu.Unlock()
	if refusedOne { // logged, counted, and new streams stop waiting
		s.w.b.shardDenied(s.id, fmt.Errorf("%w (shard channel %s)", err, cmd.keys[0]))
	}
	if len(again) > 0 {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := s.sendEach(ctx, ps, again); err != nil {
			s.kill(ps)
		}
	}
	return true
}

// sendEach subscribes each of keys with a command of its own.
func (s *shard) sendEach(ctx context.Context, ps *redis.PubSub, keys []string) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	for _, key := range keys {
		if err := s.sendSubscribe(ctx, ps, []string{key}); err != nil {
			return err
		}
	}
	return nil
}

// retryRefused asks Redis again for a few of the refused keys not already
// asked, when a retry is due.
func (s *shard) retryRefused(ctx context.Context, ps *redis.PubSub) {
	s.mu.Lock()
	if len(s.refused) == 0 || time.Now().Before(s.nextRetry) {
		s.mu.Unlock()
		return
	}
	s.nextRetry = time.Now().Add(refusedRetry)
	keys := s.nextRefusedLocked()
	s.awaitLocked(len(keys))
	s.mu.Unlock()
	if len(keys) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.sendEach(ctx, ps, keys); err != nil {
		s.kill(ps)
	}
}

// nextRefusedLocked returns the next refusedRetryBatch refused keys not
// asked already, in turn (in name order, on from where the last retry
// stopped): with hundreds refused, an ACL that grants a few of them is
// noticed within a round of retries.
func (s *shard) nextRefusedLocked() []string {
	idle := make([]string, 0, len(s.refused))
	for key, inFlight := range s.refused {
		if !inFlight {
			idle = append(idle, key)
		}
	}
	if len(idle) <= refusedRetryBatch {
		return idle
	}
	slices.Sort(idle)
	from, _ := slices.BinarySearch(idle, s.retriedUpTo)
	keys := make([]string, 0, refusedRetryBatch)
	for i := range refusedRetryBatch {
		keys = append(keys, idle[(from+i)%len(idle)])
	}
	s.retriedUpTo = keys[len(keys)-1] + "\x00" // the next retry starts after it
	return keys
}

// retryWait is how long receive may wait for a message before a retry of
// refused keys is due (retryRefused runs when it wakes): at most wait, the
// check interval, which may be far longer than refusedRetry. Keys asked
// again and not answered yet are not due: a connection that answers
// nothing is found silent as ever, after three check intervals.
func (s *shard) retryWait(wait time.Duration) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, inFlight := range s.refused { // few are in flight, but just after a reconnection
		if !inFlight {
			return min(wait, max(time.Until(s.nextRetry), time.Millisecond))
		}
	}
	return wait
}

// forgetRefusedLocked drops the refusals of keys the shard no longer
// carries; it reports whether none is left of a refusal there was.
func (s *shard) forgetRefusedLocked() (ended bool) {
	if len(s.refused) == 0 {
		return false
	}
	for key := range s.refused {
		if _, carried := s.keys[key]; !carried {
			delete(s.refused, key)
		}
	}
	return len(s.refused) == 0
}
