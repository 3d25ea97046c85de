package caddysse

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// RedisConfig connects a handler to Redis, for fan-out across instances and
// a history every instance can replay from (SPEC S9). Every handler of a
// process with the same Redis settings shares one client and one set of
// pub/sub connections, which survive config reloads.
type RedisConfig struct {
	// tlsSum is the checksum of the TLS files (CA, client certificate and
	// key) as applyTLS read them, for the hub's key.
	tlsSum string

	// URL is a redis:// or rediss:// URL
	// (redis://[user[:password]@]host[:port][/db]), or a unix:// URL of a
	// Unix socket (unix://[user[:password]@]/path/to/redis.sock); global placeholders such
	// as {env.REDIS_URL} are replaced when the config is loaded. Give either
	// URL or Addresses.
	URL string `json:"url,omitempty"`

	// Addresses are host:port of the Redis server, of the seed nodes of a
	// cluster (several addresses imply a cluster), or of the Sentinels when
	// Sentinel is set.
	Addresses []string `json:"addresses,omitempty"`

	// Cluster forces cluster mode for a single configuration endpoint.
	Cluster bool `json:"cluster,omitempty"`

	// Sentinel is the name of the master the Sentinels at Addresses watch.
	// Placeholders are replaced at load.
	Sentinel string `json:"sentinel,omitempty"`

	// SentinelUsername is the ACL user the Sentinels themselves require,
	// which may differ from the data nodes' Username. Placeholders are
	// replaced at load.
	SentinelUsername string `json:"sentinel_username,omitempty"`

	// SentinelPassword is the password the Sentinels themselves require
	// (their requirepass), e.g. {env.SENTINEL_PASSWORD}; Password is the
	// data nodes'. Placeholders are replaced at load.
	SentinelPassword string `json:"sentinel_password,omitempty"`

	// Username is the ACL user of the data nodes. Placeholders are replaced
	// at load.
	Username string `json:"username,omitempty"`

	// Password is the data nodes' password, e.g. {env.REDIS_PASSWORD}.
	// Placeholders are replaced at load.
	Password string `json:"password,omitempty"`

	// DB is the database number (not for clusters). Given, it wins over a
	// database in the URL, 0 included.
	DB *int `json:"db,omitempty"`

	// TLS enables TLS (as does a rediss:// URL).
	TLS *RedisTLS `json:"tls,omitempty"`

	// Prefix starts every key and shard channel of this module. Default:
	// "sse:". Handlers with different prefixes on one Redis do not see each
	// other's events. Placeholders are replaced at load; braces are refused
	// (Redis Cluster would hash every key by them into one slot).
	Prefix string `json:"prefix,omitempty"`

	// WaitReplicas makes a publish wait (Redis WAIT) until this many
	// replicas have the event, which narrows the events a failover can
	// lose. Default: 0 (do not wait).
	WaitReplicas int `json:"wait_replicas,omitempty"`

	// WaitTimeout bounds that wait. Default: 1s; at least 1ms (WAIT takes
	// whole milliseconds).
	WaitTimeout caddy.Duration `json:"wait_timeout,omitempty"`

	// PoolSize is the size of go-redis' pool of command connections.
	// Default: go-redis' own (10 per CPU). It is not a hard cap: go-redis
	// opens more during a burst, and has a pool of its own for pipelines (up
	// to 10) and the pub/sub connections (one per primary).
	PoolSize int `json:"pool_size,omitempty"`

	// DialTimeout bounds connecting. Default: go-redis' own (5s).
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`

	// ReadTimeout bounds a read. Default: go-redis' own (5s).
	ReadTimeout caddy.Duration `json:"read_timeout,omitempty"`

	// WriteTimeout bounds a write. Default: go-redis' own (= ReadTimeout).
	WriteTimeout caddy.Duration `json:"write_timeout,omitempty"`

	// MaxRetries is how often a failed command is retried; -1 for never.
	// Default: go-redis' own (3).
	MaxRetries int `json:"max_retries,omitempty"`

	// MinRetryBackoff is the least wait before a retry. Default: go-redis'
	// own (10ms). It may not be longer than MaxRetryBackoff.
	MinRetryBackoff caddy.Duration `json:"min_retry_backoff,omitempty"`

	// MaxRetryBackoff is the longest wait before a retry. Default: go-redis'
	// own (1s).
	MaxRetryBackoff caddy.Duration `json:"max_retry_backoff,omitempty"`

	// CheckInterval is how often each instance compares the channels it
	// watches with their history, to repair an announcement lost on a quiet
	// channel, and pings its pub/sub connections. Default: 5s.
	CheckInterval caddy.Duration `json:"check_interval,omitempty"`
}

// RedisTLS enables TLS to Redis.
type RedisTLS struct {
	// CA is a PEM file of the certificate authorities to trust instead of
	// the system's.
	CA string `json:"ca,omitempty"`

	// ClientCertificateFile is a PEM certificate this module presents to
	// Redis, for a Redis that authenticates its clients by certificate (a
	// self-hosted Redis with TLS does by default: tls-auth-clients yes).
	// Give it with ClientCertificateKeyFile.
	ClientCertificateFile string `json:"client_certificate_file,omitempty"`

	// ClientCertificateKeyFile is the PEM private key of
	// ClientCertificateFile.
	ClientCertificateKeyFile string `json:"client_certificate_key_file,omitempty"`

	// ServerName is the name Redis' certificates must be valid for, when it
	// is not the host of the URL or of the first address: e.g. the name in
	// the certificates of a Sentinel's or a cluster's nodes, which are
	// reached by the addresses those announce.
	ServerName string `json:"server_name,omitempty"`
}

// redisOptions resolves placeholders, parses the URL and builds the broker
// options. It does not connect. fallback local is not among them: it is
// the handler's, given with each publish (pubsub.WithFallbackLocal), as
// the handlers of one Redis share its hub.
func (c *RedisConfig) redisOptions() (pubsub.RedisOptions, error) {
	repl := caddy.NewReplacer()
	opts := pubsub.RedisOptions{
		Cluster:      c.Cluster,
		WaitReplicas: c.WaitReplicas, WaitTimeout: time.Duration(c.WaitTimeout),
		PoolSize: c.PoolSize, DialTimeout: time.Duration(c.DialTimeout),
		ReadTimeout: time.Duration(c.ReadTimeout), WriteTimeout: time.Duration(c.WriteTimeout),
		MaxRetries: c.MaxRetries, MinRetryBackoff: time.Duration(c.MinRetryBackoff),
		MaxRetryBackoff: time.Duration(c.MaxRetryBackoff), CheckInterval: time.Duration(c.CheckInterval),
	}
	if err := c.applyCredentials(&opts, repl); err != nil {
		return opts, err
	}
	if err := c.applyNames(&opts, repl); err != nil {
		return opts, err
	}
	for _, a := range c.Addresses {
		addr, err := resolveAtLoad(repl, "address", a)
		if err != nil {
			return opts, err
		}
		opts.Addrs = append(opts.Addrs, addr)
	}
	if c.URL != "" && len(c.Addresses) > 0 {
		return opts, errors.New("redis: give a URL or addresses, not both")
	}
	if c.URL != "" {
		raw, err := resolveAtLoad(repl, "URL", c.URL)
		if err != nil {
			return opts, err
		}
		if err := applyURL(&opts, raw); err != nil {
			return opts, err
		}
	}
	if c.DB != nil {
		opts.DB = *c.DB
	}
	if err := c.applyTLS(&opts); err != nil {
		return opts, err
	}
	return opts, validateRedisOptions(opts)
}

// applyCredentials resolves the placeholders of the credentials. One given
// that resolves to nothing (an unset {env.REDIS_PASSWORD}) is an error, as
// for the URL: connecting without it would fail later, and far less
// clearly (every stream and publish refused 503, NOAUTH).
func (c *RedisConfig) applyCredentials(opts *pubsub.RedisOptions, repl *caddy.Replacer) error {
	for _, cred := range []struct {
		name     string
		raw      string
		resolved *string
	}{{"username", c.Username, &opts.Username}, {"password", c.Password, &opts.Password},
		{"sentinel_username", c.SentinelUsername, &opts.SentinelUsername},
		{"sentinel_password", c.SentinelPassword, &opts.SentinelPassword}} {
		resolved, err := resolveAtLoad(repl, cred.name, cred.raw)
		if err != nil {
			return err
		}
		*cred.resolved = resolved
	}
	return nil
}

// applyNames resolves the placeholders of the key prefix and of the
// Sentinel master's name, as of the other settings: unresolved, a prefix of
// {env.APP}: was taken as it is written — every instance sharing it whatever
// APP said, and its braces a Redis Cluster hash tag.
func (c *RedisConfig) applyNames(opts *pubsub.RedisOptions, repl *caddy.Replacer) error {
	prefix, err := resolveAtLoad(repl, "prefix", c.Prefix)
	if err != nil {
		return err
	}
	if strings.ContainsAny(prefix, "{}") {
		// Redis Cluster hashes a key by its first {…}: the prefix's would put
		// every channel, lease and throttle in one slot, on one primary
		return fmt.Errorf("redis: prefix %q must not hold { or }: Redis Cluster would hash every key by them into one slot", prefix)
	}
	opts.Prefix = prefix
	opts.MasterName, err = resolveAtLoad(repl, "sentinel", c.Sentinel)
	return err
}

// resolveAtLoad replaces the global placeholders of a setting. A
// placeholder that resolves to nothing (an unset {env.REDIS_PASSWORD}) is
// an error wherever it is, not only when it is the whole value: inside a
// URL it left the URL without its password (NOAUTH at the first request)
// or without its host (go-redis dials localhost). The error names neither
// the value nor the placeholder: it may hold the password. Unknown
// placeholders are kept as they are.
func resolveAtLoad(repl *caddy.Replacer, name, raw string) (string, error) {
	resolved := repl.ReplaceKnown(raw, "")
	switch {
	case raw == "":
		return "", nil
	case strings.TrimSpace(resolved) == "" && name == "URL":
		return "", errors.New("redis: the URL is empty (is its environment variable set?)")
	case strings.TrimSpace(resolved) == "":
		return "", fmt.Errorf("redis: %s is empty (is its environment variable set?)", name)
	}
	if _, err := repl.ReplaceOrErr(raw, true, false); err != nil {
		return "", fmt.Errorf("redis: a placeholder in the %s resolves to nothing (is its environment variable set?)", name)
	}
	return resolved, nil
}

// applyURL takes the address, credentials, database and TLS of a URL;
// settings given separately win over the URL's.
func applyURL(opts *pubsub.RedisOptions, raw string) error {
	if strings.TrimSpace(raw) == "" {
		return errors.New("redis: the URL is empty (is its environment variable set?)")
	}
	if parsed, err := url.Parse(raw); err == nil && parsed.Scheme == "unix" && parsed.Host != "" {
		// go-redis would ignore the host: unix://run/redis.sock is /redis.sock
		if mayQuotePassword(raw) {
			return errors.New("redis: a unix:// URL takes an absolute path and no host: unix://[user[:password]@]/path/to/redis.sock")
		}
		return fmt.Errorf("redis: a unix:// URL takes an absolute path and no host: unix:///%s%s", parsed.Host, parsed.Path)
	}
	if parsed, err := url.Parse(raw); err == nil && parsed.RawQuery != "" {
		// go-redis reads options from the query (pool_size, timeouts, ...);
		// they would be silently left out of the client this module makes
		return errors.New("redis: options in the URL's query are not used: set them in the redis block (db, pool_size, dial_timeout, read_timeout, write_timeout, max_retries)")
	}
	u, err := redis.ParseURL(raw)
	if err != nil {
		// url.Error quotes the whole URL, password and all: keep only why
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		if mayQuotePassword(raw) {
			// and so may the reason: an unescaped / # or ? in the password
			// ends the host there, so that the password's start is read as
			// a port ("invalid port \":pass\" after host") and its rest as
			// the path (go-redis: "invalid database number: \"word@host\"")
			return errors.New("redis: malformed URL (the reason is left out, as it could quote the password): " +
				"percent-encode the password's reserved characters (/ # ? @ % : and spaces), or give it in the password setting")
		}
		return fmt.Errorf("redis: malformed URL: %v", err)
	}
	opts.Addrs = append([]string{u.Addr}, opts.Addrs...)
	if opts.Username == "" {
		opts.Username = u.Username
	}
	if opts.Password == "" {
		opts.Password = u.Password
	}
	opts.DB = u.DB // the db setting, if given, is applied after this
	if u.TLSConfig != nil && opts.TLS == nil {
		opts.TLS = u.TLSConfig
	}
	return nil
}

// mayQuotePassword reports whether a URL that does not parse may hold a
// password that its error or its echo would quote: one with an '@'. Where
// its authority ends cannot be told from a malformed URL, so the userinfo
// cannot be cut out of it.
func mayQuotePassword(raw string) bool { return strings.Contains(raw, "@") }

func (c *RedisConfig) applyTLS(opts *pubsub.RedisOptions) error {
	if c.TLS == nil {
		return nil
	}
	if opts.TLS == nil {
		opts.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		if host, _, err := net.SplitHostPort(firstOr(opts.Addrs, "")); err == nil {
			opts.TLS.ServerName = host
		}
	}
	repl := caddy.NewReplacer()
	name, err := resolveAtLoad(repl, "tls server_name", c.TLS.ServerName)
	if err != nil {
		return err // an unset variable would check the certificates against the host instead
	}
	if name != "" {
		opts.TLS.ServerName = name
	}
	sums := sha256.New()
	if err := c.TLS.applyCA(opts.TLS, repl, sums); err != nil {
		return err
	}
	if err := c.TLS.applyClientCertificate(opts.TLS, repl, sums); err != nil {
		return err
	}
	c.tlsSum = fmt.Sprintf("%x", sums.Sum(nil))
	return nil
}

// applyCA trusts the CA file's authorities instead of the system's.
func (t *RedisTLS) applyCA(conf *tls.Config, repl *caddy.Replacer, sums hash.Hash) error {
	if t.CA == "" {
		return nil
	}
	pem, err := readTLSFile(repl, "the CA file", t.CA, sums)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("redis: tls: no certificate in %s", t.CA)
	}
	conf.RootCAs = pool
	return nil
}

// applyClientCertificate makes the module present the client certificate,
// if one is set. It is read at load, as the CA is: a reload after the files
// were replaced gets a hub that presents the new one (the files are in the
// hub's key through their checksum).
func (t *RedisTLS) applyClientCertificate(conf *tls.Config, repl *caddy.Replacer, sums hash.Hash) error {
	if t.ClientCertificateFile == "" && t.ClientCertificateKeyFile == "" {
		return nil
	}
	if t.ClientCertificateFile == "" || t.ClientCertificateKeyFile == "" {
		return errors.New("redis: tls: a client certificate needs both its certificate file and its key file")
	}
	certPEM, err := readTLSFile(repl, "the client certificate", t.ClientCertificateFile, sums)
	if err != nil {
		return err
	}
	keyPEM, err := readTLSFile(repl, "the client certificate's key", t.ClientCertificateKeyFile, sums)
	if err != nil {
		return err
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("redis: tls: client certificate %s: %v", t.ClientCertificateFile, err)
	}
	conf.Certificates = []tls.Certificate{pair}
	return nil
}

// readTLSFile reads a TLS file (its name's placeholders replaced) and adds
// its checksum to sums.
func readTLSFile(repl *caddy.Replacer, what, name string, sums hash.Hash) ([]byte, error) {
	data, err := os.ReadFile(repl.ReplaceKnown(name, ""))
	if err != nil {
		return nil, fmt.Errorf("redis: tls: reading %s: %v", what, err)
	}
	sum := sha256.Sum256(data)
	sums.Write(sum[:])
	return data, nil
}

func firstOr(xs []string, def string) string {
	if len(xs) > 0 {
		return xs[0]
	}
	return def
}

func validateAddresses(o pubsub.RedisOptions) error {
	for _, a := range o.Addrs {
		if strings.HasPrefix(a, "/") { // go-redis dials a path as a Unix socket
			return validateUnixSocket(o)
		}
		_, port, err := net.SplitHostPort(a)
		if err != nil || port == "" {
			return fmt.Errorf("redis: address %q is not host:port", a)
		}
		if n, err := strconv.Atoi(port); err == nil && (n < 1 || n > 65535) {
			// refused here, not at the first dial, long after the config
			// loaded (a name, such as "redis", is a service the dialer looks up)
			return fmt.Errorf("redis: address %q: the port must be from 1 to 65535", a)
		}
	}
	return nil
}

// validateUnixSocket checks the options of a Unix socket (a unix:// URL,
// or an address that is a path): one server.
func validateUnixSocket(o pubsub.RedisOptions) error {
	if len(o.Addrs) != 1 || o.Cluster || o.MasterName != "" {
		return errors.New("redis: a Unix socket is one server: not with other addresses, a cluster or Sentinels")
	}
	return nil
}

func validateRedisOptions(o pubsub.RedisOptions) error {
	if len(o.Addrs) == 0 {
		return errors.New("redis: give a URL or addresses")
	}
	if err := validateAddresses(o); err != nil {
		return err
	}
	if o.MasterName != "" && o.Cluster {
		// Sentinel watches one primary, a cluster has many: one would be
		// silently left out
		return errors.New("redis: cluster or sentinel <master-name>, not both")
	}
	if o.MasterName == "" && (o.SentinelUsername != "" || o.SentinelPassword != "") {
		return errors.New("redis: sentinel_username and sentinel_password need sentinel <master-name>")
	}
	if o.MasterName == "" && (o.Cluster || len(o.Addrs) > 1) && o.DB != 0 {
		return errors.New("redis: a cluster has only database 0")
	}
	if o.WaitReplicas < 0 || o.PoolSize < 0 || o.DB < 0 {
		return errors.New("redis: wait_replicas, pool_size and db must not be negative")
	}
	if o.MaxRetries < -1 {
		return errors.New("redis: max_retries must be -1 (never) or more")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"wait_timeout", o.WaitTimeout}, {"dial_timeout", o.DialTimeout}, {"read_timeout", o.ReadTimeout},
		{"write_timeout", o.WriteTimeout}, {"min_retry_backoff", o.MinRetryBackoff},
		{"max_retry_backoff", o.MaxRetryBackoff}, {"check_interval", o.CheckInterval}} {
		if d.v < 0 {
			return fmt.Errorf("redis: %s must not be negative", d.name)
		}
	}
	if o.WaitTimeout > 0 && o.WaitTimeout < time.Millisecond {
		// WAIT takes whole milliseconds, and waits for ever on 0
		return errors.New("redis: wait_timeout must be at least 1ms")
	}
	return checkRetryBackoffs(o.MinRetryBackoff, o.MaxRetryBackoff)
}

// checkRetryBackoffs refuses a min_retry_backoff longer than the
// max_retry_backoff (go-redis' default for a max left out): go-redis
// would wait the max before every retry, the min silently left out. A max
// given alone under go-redis' default min is what was asked for (each
// retry waits that max): no min of the config is left out.
func checkRetryBackoffs(least, most time.Duration) error {
	if least == 0 {
		return nil
	}
	o := pubsub.RedisOptions{MinRetryBackoff: least, MaxRetryBackoff: most}.WithDefaults()
	if o.MinRetryBackoff > o.MaxRetryBackoff {
		return fmt.Errorf("redis: min_retry_backoff (%v) must not be longer than max_retry_backoff (%v)", o.MinRetryBackoff, o.MaxRetryBackoff)
	}
	return nil
}

// hubKey identifies a Redis hub in the pool: every setting as the broker
// and go-redis use it (defaults filled in: WithDefaults), so that a reload with the same
// settings keeps the hub (and its subscriptions) and a reload with other
// settings gets a hub that uses them. Only Redis settings: handler
// settings such as fallback local are not in the options, so every handler
// with the same Redis settings shares its hub (SPEC S1). tlsSum is the
// checksum of the TLS files: a reload after one was replaced (a rotated CA
// or client certificate) uses the new one. The password is in it only as
// part of an in-memory map key.
func hubKeyOf(o pubsub.RedisOptions, files *RedisTLS, tlsSum string) string {
	o = o.WithDefaults()
	o.Logger = nil
	tlsOn, serverName := o.TLS != nil, ""
	if tlsOn {
		serverName = o.TLS.ServerName
	}
	o.TLS = nil
	raw, _ := json.Marshal(struct {
		pubsub.RedisOptions
		TLS           bool
		TLSServerName string
		TLSFiles      *RedisTLS
		TLSSum        string
	}{o, tlsOn, serverName, files, tlsSum})
	return "redis " + string(raw)
}

// unmarshalRedis parses `redis <url>` or a redis block.
func (c *RedisConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		c.URL = d.Val()
		if d.NextArg() {
			return d.ArgErr()
		}
		if d.NextBlock(d.Nesting()) {
			return d.Err("redis: give a URL or a block, not both")
		}
		return nil
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := onceIn(d, seen, "redis"); err != nil {
			return err
		}
		if err := c.unmarshalSubdirective(d, d.Val()); err != nil {
			return err
		}
	}
	switch {
	case c.URL == "" && len(c.Addresses) == 0:
		return d.Err("redis: give a URL or addresses")
	case c.URL != "" && len(c.Addresses) > 0:
		return d.Err("redis: give a URL or addresses, not both")
	case c.Cluster && c.Sentinel != "":
		return d.Err("redis: cluster or sentinel <master-name>, not both")
	}
	if err := checkRetryBackoffs(time.Duration(c.MinRetryBackoff), time.Duration(c.MaxRetryBackoff)); err != nil {
		return d.Err(err.Error()) // validateRedisOptions refuses it too, without the line
	}
	return nil
}

func (c *RedisConfig) unmarshalSubdirective(d *caddyfile.Dispenser, name string) error {
	switch name {
	case "url":
		return oneString(d, &c.URL)
	case "addresses":
		c.Addresses = d.RemainingArgs()
		if len(c.Addresses) == 0 {
			return d.ArgErr()
		}
		return nil
	case "cluster":
		if d.NextArg() {
			return d.ArgErr()
		}
		c.Cluster = true
		return nil
	case "sentinel":
		return oneString(d, &c.Sentinel)
	case "sentinel_username":
		return oneString(d, &c.SentinelUsername)
	case "sentinel_password":
		return oneString(d, &c.SentinelPassword)
	case "username":
		return oneString(d, &c.Username)
	case "password":
		return oneString(d, &c.Password)
	case "db":
		c.DB = new(int)
		return oneNonNegative(d, c.DB)
	case "tls":
		return c.unmarshalTLS(d)
	case "prefix":
		return oneString(d, &c.Prefix)
	case "wait_replicas":
		return c.unmarshalWait(d)
	case "pool_size":
		return oneInt(d, &c.PoolSize)
	case "max_retries":
		return c.unmarshalRetries(d)
	case "dial_timeout":
		return oneDuration(d, &c.DialTimeout)
	case "read_timeout":
		return oneDuration(d, &c.ReadTimeout)
	case "write_timeout":
		return oneDuration(d, &c.WriteTimeout)
	case "min_retry_backoff":
		return oneDuration(d, &c.MinRetryBackoff)
	case "max_retry_backoff":
		return oneDuration(d, &c.MaxRetryBackoff)
	case "check_interval":
		return oneDuration(d, &c.CheckInterval)
	default:
		return d.Errf("unrecognized redis subdirective %q", name)
	}
}

func (c *RedisConfig) unmarshalWait(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) < 1 || len(args) > 2 {
		return d.ArgErr()
	}
	n, err := strconv.Atoi(args[0])
	if err != nil || n < 0 {
		return d.Errf("wait_replicas: count must be a non-negative integer, got %q", args[0])
	}
	c.WaitReplicas = n
	if len(args) == 2 {
		dur, err := caddy.ParseDuration(args[1])
		if err != nil || dur < time.Millisecond {
			// WAIT takes whole milliseconds, and waits for ever on 0
			return d.Errf("wait_replicas: timeout must be a duration of at least 1ms, got %q", args[1])
		}
		c.WaitTimeout = caddy.Duration(dur)
	}
	return nil
}

func (c *RedisConfig) unmarshalRetries(d *caddyfile.Dispenser) error {
	var s string
	if err := oneString(d, &s); err != nil {
		return err
	}
	n, err := strconv.Atoi(s)
	switch {
	case err != nil || n < -1:
		return d.Errf("max_retries: must be -1 (never) or more, got %q", s)
	case n == 0:
		// go-redis reads 0 as "its default" (3): a 0 written here, meant
		// as none, would retry three times
		return d.Err("max_retries: 0 would mean go-redis' default (3 retries); write -1 for none, or leave it out")
	}
	c.MaxRetries = n
	return nil
}

// unmarshalTLS parses `tls [<ca-file>]` and its optional block:
//
//	tls [<ca-file>] {
//		ca <ca-file>
//		client_auth <cert-file> <key-file>
//		server_name <name>
//	}
func (c *RedisConfig) unmarshalTLS(d *caddyfile.Dispenser) error {
	c.TLS = &RedisTLS{}
	if d.NextArg() {
		c.TLS.CA = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := onceIn(d, seen, "redis tls"); err != nil {
			return err
		}
		if err := c.TLS.unmarshalSubdirective(d, d.Val()); err != nil {
			return err
		}
	}
	return nil
}

func (t *RedisTLS) unmarshalSubdirective(d *caddyfile.Dispenser, name string) error {
	switch name {
	case "ca":
		if t.CA != "" {
			return d.Err("redis tls: the CA file is given twice (after tls and as ca)")
		}
		return oneString(d, &t.CA)
	case "client_auth":
		args := d.RemainingArgs()
		if len(args) != 2 {
			return d.Err("redis tls: client_auth takes a certificate file and its key file")
		}
		t.ClientCertificateFile, t.ClientCertificateKeyFile = args[0], args[1]
		return nil
	case "server_name":
		return oneString(d, &t.ServerName)
	default:
		return d.Errf("unrecognized redis tls subdirective %q", name)
	}
}
