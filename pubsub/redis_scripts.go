package pubsub

import (
	"context"
	"regexp"
	"strings"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Some Redis deployments forbid functions (ACLs without FUNCTION, managed
// services). The same code then runs as plain scripts (EVALSHA, and EVAL
// when Redis does not know the script yet): evalScript derives each one from
// the function library, so there is one source of truth. The derived
// scripts are also committed as redis_eval_*.lua for backends that publish
// with EVAL (a test keeps them in step with redis.lua).

// evalScript turns the library into a script that runs one of its
// functions with EVAL's KEYS and ARGV.
func evalScript(function string) string {
	var b strings.Builder
	b.WriteString("-- generated from redis.lua by caddy-sse (see redis_scripts.go); do not edit\n")
	for line := range strings.SplitSeq(redisFunctions, "\n") {
		if strings.HasPrefix(line, "#!lua") || strings.HasPrefix(line, "redis.register_function") {
			continue
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	callback := map[string]string{FunctionPublish: "publish", FunctionPublishV2: "publish_v2",
		FunctionPublishOnce: "publish_once_v2", FunctionPublishCounted: "publish_once_v3", FunctionRead: "read_v2",
		FunctionOpen: "open"}[function]
	b.WriteString("return " + callback + "(KEYS, ARGV)\n")
	return b.String()
}

// scripts holds every function the broker calls: publishWhileMigrating
// calls FunctionPublishV2 too.
var scripts = map[string]*redis.Script{
	FunctionPublish:        redis.NewScript(evalScript(FunctionPublish)),
	FunctionPublishV2:      redis.NewScript(evalScript(FunctionPublishV2)),
	FunctionPublishOnce:    redis.NewScript(evalScript(FunctionPublishOnce)),
	FunctionPublishCounted: redis.NewScript(evalScript(FunctionPublishCounted)),
	FunctionRead:           redis.NewScript(evalScript(FunctionRead)),
	FunctionOpen:           redis.NewScript(evalScript(FunctionOpen)),
}

// runScript runs a function's script form (EVALSHA, or EVAL if Redis does
// not have it cached).
func runScript(ctx context.Context, c redis.Scripter, key, function string, args ...any) (any, error) {
	s, keys := scripts[function], functionKeys(function, key, args)
	if readOnly(function) {
		return s.RunRO(ctx, c, keys, args...).Result()
	}
	return s.Run(ctx, c, keys, args...).Result()
}

// functionsForbidden reports whether Redis refused the function commands
// themselves: an ACL without FCALL or FUNCTION (NOPERM ... the 'fcall'
// command), or a server or proxy that does not have them (unknown command
// 'FCALL'). Nothing else is: the broker uses scripts for good after it, so
// a passing refusal such as "OOM command not allowed" must not count.
func functionsForbidden(err error) bool {
	if err == nil {
		return false
	}
	msg := strings.ToLower(err.Error())
	switch {
	case strings.HasPrefix(msg, "noperm"):
		return forbiddenCommand.MatchString(msg)
	case strings.Contains(msg, "unknown command"):
		return unknownFunctionCommand.MatchString(msg)
	}
	return false
}

var (
	// the command a NOPERM names: 'fcall', 'fcall_ro', 'function|load'
	forbiddenCommand = regexp.MustCompile(`run the ['"` + "`" + `](fcall|fcall_ro|function)\b`)
	// ERR unknown command 'FCALL', with args beginning with: ...
	unknownFunctionCommand = regexp.MustCompile(`unknown command ['"` + "`" + `]?(fcall|fcall_ro|function)\b`)
)

// useScripts switches the broker to scripts for good, once.
func (b *Redis) useScripts(err error) {
	if !b.scriptsOnly.Swap(true) {
		b.log().Warn("redis refuses functions; using EVALSHA scripts instead (direct publishers must use EVAL too)", zap.Error(err))
	}
}
