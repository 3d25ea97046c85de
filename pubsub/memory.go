package pubsub

import (
	"context"
	"sync"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// sweepInterval is how often the embedded broker frees expired history.
const sweepInterval = time.Minute

// Memory is the embedded broker: one process, history in a replay.Memory
// ring buffer per channel. Appending and delivering happen under the
// channel's lock, so every subscriber sees a channel's events in order.
type Memory struct {
	log     *replay.Memory
	deliver DeliverFunc

	watchMu sync.Mutex
	watched map[string]struct{} // channels with subscribers on the hub
	// left holds when the last subscriber of a channel left it, until a
	// sweep has seen it: the sweep keeps the channel's head 2*max age from
	// then, also for a stream that came and went between two sweeps
	left map[string]time.Time

	sweepOnce sync.Once
	stop      chan struct{}
	stopOnce  sync.Once
}

// NewMemory returns an embedded broker that hands every event to deliver.
func NewMemory(deliver DeliverFunc) *Memory {
	return &Memory{log: replay.NewMemory(), deliver: deliver, watched: make(map[string]struct{}), left: make(map[string]time.Time), stop: make(chan struct{})}
}

// Publish encodes msg once, appends it to the channel's ring and delivers it
// to this process's subscribers.
func (m *Memory) Publish(ctx context.Context, channel string, msg Message, lim replay.Limits) (replay.Position, error) {
	select {
	case <-m.stop:
		return replay.Position{}, ErrClosed
	default:
	}
	m.sweepOnce.Do(func() { go m.sweep() })
	frame := wire.AppendEvent(make([]byte, 0, frameSize(msg)), msg.Type, msg.Data)
	ev := m.log.Append(channel, frame, lim, func(ev *replay.Event) { m.deliver(channel, ev) })
	return ev.Pos, nil
}

// frameSize estimates the encoded size of msg, to allocate its frame once.
func frameSize(msg Message) int {
	return len("event: \n") + len(msg.Type) + len("data: \n") + len(msg.Data) + len(msg.Data)/16
}

// Read returns the channel's history after position after.
func (m *Memory) Read(_ context.Context, channel string, after *replay.Position, limit int) (replay.Page, error) {
	return m.log.Read(channel, after, limit), nil
}

// Watch notes that the hub has subscribers on channel (every event is
// delivered to the hub already): the sweep keeps its history's head, so
// that its next event follows their position however quiet it stays.
func (m *Memory) Watch(channel string) {
	// the sweeps also empty left, which Unwatch fills even if nothing is
	// ever published
	m.sweepOnce.Do(func() { go m.sweep() })
	m.watchMu.Lock()
	m.watched[channel] = struct{}{}
	delete(m.left, channel)
	m.watchMu.Unlock()
}

// Unwatch notes that the hub has no subscriber left on channel.
//
// Only a channel with a history is noted in left: one nobody has
// published to has no head to keep (an event published to it later is
// newer than the leave), and clients name the channels of their streams
// (public:{query.topics}), so noting every one let a client fill left with
// millions of names between two sweeps. The log is asked before watchMu
// is taken: the sweep takes the log's locks, then watchMu.
func (m *Memory) Unwatch(channel string) {
	kept := m.log.Holds(channel)
	m.watchMu.Lock()
	delete(m.watched, channel)
	if kept {
		m.left[channel] = time.Now()
	}
	m.watchMu.Unlock()
}

// watchState reports whether the hub has subscribers on channel now, and
// if not, when the last one left (zero if not since the last sweep).
func (m *Memory) watchState(channel string) (bool, time.Time) {
	m.watchMu.Lock()
	defer m.watchMu.Unlock()
	if _, ok := m.watched[channel]; ok {
		return true, time.Time{}
	}
	return false, m.left[channel]
}

// Sweep frees the expired history now, as the broker does every minute:
// old events, and quiet channels that no subscriber of the hub watches.
func (m *Memory) Sweep() {
	start := time.Now()
	m.log.SweepWatched(m.watchState)
	// the sweep stamped the channels that were left before it began; those
	// left since are seen by the next one
	m.watchMu.Lock()
	for channel, at := range m.left {
		if !at.After(start) {
			delete(m.left, channel)
		}
	}
	m.watchMu.Unlock()
}

// Close stops the sweeper.
func (m *Memory) Close() error {
	m.stopOnce.Do(func() { close(m.stop) })
	return nil
}

// Log exposes the history, for statistics and tests.
func (m *Memory) Log() *replay.Memory { return m.log }

func (m *Memory) sweep() {
	t := time.NewTicker(sweepInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			m.Sweep()
		case <-m.stop:
			return
		}
	}
}
