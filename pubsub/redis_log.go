package pubsub

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
)

// go-redis logs through one process-wide logger, to stderr by default: a
// line for every failed dial while Redis is down. Those go to zap at debug
// level instead (through the newest logger any broker was given); the
// broker itself logs each down/up transition once.
var (
	routeRedisLogs sync.Once
	goRedisLogs    logStack
)

type zapRedisLogger struct{}

func (zapRedisLogger) Printf(_ context.Context, format string, v ...any) {
	if ce := goRedisLogs.current().Check(zap.DebugLevel, "go-redis"); ce != nil {
		ce.Write(zap.String("message", fmt.Sprintf(format, v...)))
	}
}

// logStack holds the loggers in use, the newest last: logs go through the
// newest. A broker outlives the config that made it (a Caddy reload keeps
// it), so it must log where, and at the level, the running config says,
// not through a logger of a config long gone.
type logStack struct {
	mu   sync.Mutex
	list []*zap.Logger
	cur  atomic.Pointer[zap.Logger]
}

// nopLogger is the logger of a logStack with none.
var nopLogger = zap.NewNop()

// current returns the newest logger in use (a no-op one if none).
func (s *logStack) current() *zap.Logger {
	if l := s.cur.Load(); l != nil {
		return l
	}
	return nopLogger
}

// push makes l the current logger until pop(l).
func (s *logStack) push(l *zap.Logger) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.list = append(s.list, l)
	s.cur.Store(l)
}

// pop takes l out; the newest of the others becomes current.
func (s *logStack) pop(l *zap.Logger) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if i := slices.Index(s.list, l); i >= 0 {
		s.list = slices.Delete(s.list, i, i+1)
	}
	var cur *zap.Logger
	if n := len(s.list); n > 0 {
		cur = s.list[n-1]
	}
	s.cur.Store(cur)
}

// log returns the logger the broker logs through.
func (b *Redis) log() *zap.Logger { return b.logs.current() }

// UseLogger makes the broker (and go-redis) log through l until the
// returned release is called, then through the newest logger still in use,
// or the one it was made with. Each user of a broker shared across config
// reloads hands it its own, so that a new config's logging (its outputs,
// its level) applies to the broker too.
func (b *Redis) UseLogger(l *zap.Logger) (release func()) {
	b.logs.push(l)
	goRedisLogs.push(l)
	var once sync.Once
	return func() {
		once.Do(func() {
			b.logs.pop(l)
			goRedisLogs.pop(l)
		})
	}
}
