package pubsub

import (
	"context"
	"fmt"
	"sync"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// go-redis logs through one process-wide logger, to stderr by default: a
// line for every failed dial while Redis is down. Those go to zap at debug
// level instead; the broker itself logs each down/up transition once.
var routeRedisLogs sync.Once

type zapRedisLogger struct{ log *zap.Logger }

func (z zapRedisLogger) Printf(_ context.Context, format string, v ...any) {
	if ce := z.log.Check(zap.DebugLevel, "go-redis"); ce != nil {
		ce.Write(zap.String("message", fmt.Sprintf(format, v...)))
	}
}

func routeRedisLogsTo(log *zap.Logger) {
	routeRedisLogs.Do(func() { redis.SetLogger(zapRedisLogger{log}) })
}
