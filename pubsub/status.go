package pubsub

// BackendReporter is implemented by brokers that connect to an external
// backend (Redis), so that metrics can tell whether it is reachable. The
// embedded broker does not implement it.
type BackendReporter interface {
	BackendStatus() BackendStatus
}

// BackendStatus is the state of a broker's connection to its backend.
type BackendStatus struct {
	// Up is whether the backend is reachable now.
	Up bool
	// Reconnects counts the times the broker reconnected since it started.
	Reconnects uint64
	// Channels is how many channels the broker is subscribed to.
	Channels int
	// Denied is how many of them the backend refuses this instance the
	// subscription of (a Redis ACL), with the backend's answer: their
	// streams get no live events, and new ones open degraded.
	Denied      int
	DeniedError string
	// HistoryReads counts the reads of channels' histories that streams
	// asked of the backend (replays, catch-ups, recoveries), and
	// HistoryReadsSent those sent to it: streams that ask the same at once
	// share one read.
	HistoryReads, HistoryReadsSent uint64
}
