package pubsub

import (
	"crypto/tls"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"
)

// RedisOptions configure the Redis broker. The zero values of the tuning
// fields keep go-redis' defaults.
type RedisOptions struct {
	// Addrs are the Redis servers: one for a single server, the seed nodes of
	// a cluster, or the Sentinels when MasterName is set.
	Addrs []string
	// Cluster forces cluster mode for a single configuration endpoint;
	// several Addrs without MasterName imply it.
	Cluster bool
	// MasterName is the Sentinel master name; Addrs are then Sentinels.
	MasterName string
	// SentinelUsername and SentinelPassword authenticate to the Sentinels,
	// which may require other credentials than the data nodes.
	SentinelUsername string
	SentinelPassword string
	Username         string
	Password         string
	DB               int
	TLS              *tls.Config
	// Prefix starts every key and shard channel ("sse:" if empty).
	Prefix string
	// WaitReplicas makes a publish wait until that many replicas have the
	// event (Redis WAIT), for at most WaitTimeout.
	WaitReplicas int
	WaitTimeout  time.Duration

	PoolSize        int
	DialTimeout     time.Duration
	ReadTimeout     time.Duration
	WriteTimeout    time.Duration
	MaxRetries      int
	MinRetryBackoff time.Duration
	MaxRetryBackoff time.Duration

	// CheckInterval is how often each watched channel's head is compared
	// with what was delivered, to repair a lost notification on a quiet
	// channel, and how often idle pub/sub connections are pinged.
	CheckInterval time.Duration
	// RepairLimit is the most events fetched to repair one gap.
	RepairLimit int
	// FallbackLocal delivers events to this instance when Redis cannot be
	// reached, under a local epoch (see SPEC S9), instead of failing: every
	// publish, where WithFallbackLocal chooses it per publish.
	FallbackLocal bool

	Logger *zap.Logger
}

// Defaults of RedisOptions.
const (
	DefaultRedisPrefix   = "sse:"
	DefaultCheckInterval = 5 * time.Second
	DefaultRepairLimit   = 10000
)

// go-redis v9's defaults of the tuning fields (its Options.init), which
// the broker reckons with (publishOnceTTL, the stall watch).
const (
	goRedisDialTimeout = 5 * time.Second
	goRedisReadTimeout = 5 * time.Second
	goRedisMinBackoff  = 10 * time.Millisecond
	goRedisMaxBackoff  = time.Second
	goRedisMaxRetries  = 3
)

// WithDefaults returns the options with every default filled in, the
// broker's and go-redis' (the Logger left as it is; the pool size too, as
// go-redis' depends on the CPUs): two option sets that differ only in a
// default written out or left out are the same.
func (o RedisOptions) WithDefaults() RedisOptions {
	logger := o.Logger
	o.applyDefaults()
	o.Logger = logger
	zeroTo := func(d *time.Duration, def time.Duration) {
		if *d == 0 {
			*d = def
		}
	}
	zeroTo(&o.DialTimeout, goRedisDialTimeout)
	zeroTo(&o.ReadTimeout, goRedisReadTimeout)
	zeroTo(&o.WriteTimeout, o.ReadTimeout)
	zeroTo(&o.MinRetryBackoff, goRedisMinBackoff)
	zeroTo(&o.MaxRetryBackoff, goRedisMaxBackoff)
	if o.MaxRetries == 0 {
		o.MaxRetries = goRedisMaxRetries
	}
	return o
}

func (o *RedisOptions) applyDefaults() {
	if o.Prefix == "" {
		o.Prefix = DefaultRedisPrefix
	}
	if o.CheckInterval <= 0 {
		o.CheckInterval = DefaultCheckInterval
	}
	if o.RepairLimit <= 0 {
		o.RepairLimit = DefaultRepairLimit
	}
	if o.WaitReplicas > 0 && o.WaitTimeout <= 0 {
		o.WaitTimeout = time.Second
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
}

// clusterRedirects is go-redis' MaxRedirects for a cluster: the one budget
// its cluster client spends on a command's retries (network errors) and
// its redirects (MOVED, ASK). max_retries goes there, and the nodes' own
// retries are off (as go-redis has them by default): given max_retries as
// well, each of the cluster's attempts was retried on its node, (3 + 1) ×
// (max_retries + 1) copies of a call (16 with max_retries 3, beyond what
// publishOnceTTL allows for), and an unset max_retries, which the hub's key
// takes for 3, behaved otherwise than an explicit 3. -1 keeps one: a slot
// that moved must still be followed.
func (o *RedisOptions) clusterRedirects() int {
	switch {
	case o.MaxRetries == 0:
		return goRedisMaxRetries
	case o.MaxRetries < 0:
		return 1
	}
	return o.MaxRetries
}

// publishOnceTTL is how long Redis keeps a publish's reply under its token
// (FunctionPublishOnce): longer than go-redis' retries of one call can be
// apart (every attempt's dial, write and read timeouts and backoff), and
// at least 30 s.
func (o *RedisOptions) publishOnceTTL() time.Duration {
	backoff := orDefault(o.MaxRetryBackoff, goRedisMaxBackoff)
	retries := o.MaxRetries
	switch {
	case o.isCluster():
		retries = o.clusterRedirects()
	case retries == 0:
		retries = goRedisMaxRetries
	case retries < 0:
		retries = 0
	}
	window := time.Duration(retries+1)*o.attemptTimeout() + time.Duration(retries)*backoff
	return max(30*time.Second, window)
}

// readTimeout is go-redis' read timeout for these options; 0 if reads
// have none.
func (o *RedisOptions) readTimeout() time.Duration {
	return orDefault(o.ReadTimeout, goRedisReadTimeout)
}

// attemptTimeout bounds one attempt of a command: dial, write, read.
func (o *RedisOptions) attemptTimeout() time.Duration {
	read := o.readTimeout()
	return orDefault(o.DialTimeout, goRedisDialTimeout) + orDefault(o.WriteTimeout, read) + read
}

// orDefault is a go-redis timeout: def if unset, 0 if negative (none).
func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return max(d, 0)
}

// isCluster tells whether the options describe a Redis Cluster.
func (o *RedisOptions) isCluster() bool {
	return o.MasterName == "" && (o.Cluster || len(o.Addrs) > 1)
}

// newClient builds the go-redis client; it does not connect.
func (o *RedisOptions) newClient() (redis.UniversalClient, *redis.ClusterClient, error) {
	if len(o.Addrs) == 0 {
		return nil, nil, errors.New("redis: no address")
	}
	switch {
	case o.MasterName != "":
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: o.MasterName, SentinelAddrs: o.Addrs,
			SentinelUsername: o.SentinelUsername, SentinelPassword: o.SentinelPassword,
			Username: o.Username, Password: o.Password, DB: o.DB, TLSConfig: o.TLS,
			PoolSize: o.PoolSize, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
			WriteTimeout: o.WriteTimeout, MaxRetries: o.MaxRetries,
			MinRetryBackoff: o.MinRetryBackoff, MaxRetryBackoff: o.MaxRetryBackoff,
		}), nil, nil
	case o.isCluster():
		if o.DB != 0 {
			return nil, nil, errors.New("redis: a cluster has no database other than 0")
		}
		c := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: o.Addrs, Username: o.Username, Password: o.Password, TLSConfig: o.TLS,
			PoolSize: o.PoolSize, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
			WriteTimeout: o.WriteTimeout, MaxRetries: -1, MaxRedirects: o.clusterRedirects(),
			MinRetryBackoff: o.MinRetryBackoff, MaxRetryBackoff: o.MaxRetryBackoff,
			MaintNotificationsConfig: noMaintNotifications(),
		})
		return c, c, nil
	default:
		return redis.NewClient(o.nodeOptions(o.Addrs[0])), nil, nil
	}
}

// nodeOptions are the go-redis options of a client of the one server at
// addr: the single Redis, or one node of a cluster (credentials, TLS and
// timeouts as the cluster client gives its node clients).
func (o *RedisOptions) nodeOptions(addr string) *redis.Options {
	return &redis.Options{
		Addr: addr, Username: o.Username, Password: o.Password, DB: o.DB, TLSConfig: o.TLS,
		PoolSize: o.PoolSize, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
		WriteTimeout: o.WriteTimeout, MaxRetries: o.MaxRetries,
		MinRetryBackoff: o.MinRetryBackoff, MaxRetryBackoff: o.MaxRetryBackoff,
		MaintNotificationsConfig: noMaintNotifications(),
	}
}

// noMaintNotifications turns go-redis' maintenance notifications off (its
// Sentinel client has them off already). They are a Redis Enterprise
// feature; in their default "auto" mode every new connection asks for them
// (CLIENT MAINT_NOTIFICATIONS, a round trip that open-source Redis refuses)
// and, refused, go-redis turns them off by writing to the options that a
// client shares with the Conns made from it, under a lock the Conns do not
// share: a data race (go-redis v9.23; seen by the race detector on a
// publish with wait_replicas, which uses a Conn).
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
