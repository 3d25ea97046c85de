package caddysse

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

func init() {
	caddy.RegisterModule(AdminStats{})
}

// How many channels and principals GET /sse/stats lists by default, and at
// most (?top=N).
const (
	defaultStatsTop = 10
	maxStatsTop     = 1000
)

// clusterCountTimeout bounds the question to a shared backend for the
// cluster-wide count of the listed principals.
const clusterCountTimeout = 2 * time.Second

// AdminStats serves GET /sse/stats on Caddy's admin endpoint: the streams
// open on this instance, per hub (backend), with the channels and
// principals that hold the most (?top=N, default 10). With a backend shared
// by several instances whose leases can count across them, each listed
// principal also has its cluster-wide count.
type AdminStats struct{}

// CaddyModule returns the Caddy module information.
func (AdminStats) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.sse",
		New: func() caddy.Module { return new(AdminStats) },
	}
}

// Routes returns the route of the stats endpoint.
func (a AdminStats) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/sse/stats", Handler: caddy.AdminHandlerFunc(a.serveStats)}}
}

// statsReply is the body of GET /sse/stats.
type statsReply struct {
	OpenStreams int        `json:"open_streams"`
	Hubs        []hubStats `json:"hubs"`
}

type hubStats struct {
	Backend       string          `json:"backend"`
	OpenStreams   int             `json:"open_streams"`
	Channels      int             `json:"channels"`
	Principals    int             `json:"principals"`
	TopChannels   []channelStat   `json:"top_channels"`
	TopPrincipals []principalStat `json:"top_principals"`
	ClusterError  string          `json:"cluster_error,omitempty"`
	// SubscribeError is Redis' refusal of the subscription of channels
	// (an ACL): their streams get no live events, new ones open degraded
	SubscribeError string `json:"subscribe_error,omitempty"`
}

type channelStat struct {
	Channel string `json:"channel"`
	Streams int    `json:"streams"`
}

type principalStat struct {
	Principal      string `json:"principal"`
	Streams        int    `json:"streams"`
	ClusterStreams *int   `json:"cluster_streams,omitempty"`
}

// statsSource is what the stats read of a pooled hub.
type statsSource interface {
	Name() string
	Census() *pubsub.Census
	TopChannels(n int) ([]pubsub.Count, int)
	Leases() pubsub.Leases
	Broker() pubsub.Broker
}

func (AdminStats) serveStats(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errors.New("method not allowed")}
	}
	n, err := statsTop(r)
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	reply := statsReply{Hubs: []hubStats{}}
	for _, src := range pooledStatsSources() {
		hs := collectHubStats(r.Context(), src, n)
		reply.OpenStreams += hs.OpenStreams
		reply.Hubs = append(reply.Hubs, hs)
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(reply)
}

// statsTop reads ?top=N.
func statsTop(r *http.Request) (int, error) {
	raw := r.URL.Query().Get("top")
	if raw == "" {
		return defaultStatsTop, nil
	}
	n, err := strconv.Atoi(raw)
	if err != nil || n < 1 || n > maxStatsTop {
		return 0, fmt.Errorf("top must be an integer from 1 to %d", maxStatsTop)
	}
	return n, nil
}

// pooledSource is a hub in use and the name the stats give it.
type pooledSource struct {
	statsSource
	name string
}

// pooledStatsSources returns the hubs in use, by backend name. Handlers
// that name the same Redis with other connection settings (a pool size, a
// timeout) have hubs of their own, of the same name: each is told apart by
// a short hash of its settings (its key in the pool).
func pooledStatsSources() []pooledSource {
	var out []pooledSource
	var keys []string
	named := map[string]int{}
	hubs.Range(func(key, val any) bool {
		if src, ok := val.(statsSource); ok {
			out = append(out, pooledSource{src, src.Name()})
			keys = append(keys, fmt.Sprint(key))
			named[src.Name()]++
		}
		return true
	})
	for i := range out {
		if named[out[i].name] > 1 {
			sum := sha256.Sum256([]byte(keys[i]))
			out[i].name += " settings " + hex.EncodeToString(sum[:3])
		}
	}
	slices.SortFunc(out, func(a, b pooledSource) int { return cmp.Compare(a.name, b.name) })
	return out
}

func collectHubStats(ctx context.Context, src pooledSource, n int) hubStats {
	hs := hubStats{Backend: src.name, OpenStreams: src.Census().Total()}
	channels, nChannels := src.TopChannels(n)
	principals, nPrincipals := src.Census().TopPrincipals(n)
	hs.Channels, hs.Principals = nChannels, nPrincipals
	hs.TopChannels = make([]channelStat, len(channels))
	for i, c := range channels {
		hs.TopChannels[i] = channelStat{Channel: c.Name, Streams: c.Streams}
	}
	hs.TopPrincipals = make([]principalStat, len(principals))
	for i, p := range principals {
		hs.TopPrincipals[i] = principalStat{Principal: p.Name, Streams: p.Streams}
	}
	if rep, ok := src.Broker().(pubsub.BackendReporter); ok {
		if st := rep.BackendStatus(); st.Denied > 0 {
			hs.SubscribeError = fmt.Sprintf("redis refuses the subscription of %d channels: %s", st.Denied, st.DeniedError)
		}
	}
	if counter, ok := src.Leases().(pubsub.LeaseCounter); ok && len(principals) > 0 {
		hs.ClusterError = addClusterCounts(ctx, counter, hs.TopPrincipals)
	}
	return hs
}

// addClusterCounts asks shared leases for the cluster-wide count of each
// listed principal that holds a lease here (a principal whose streams here
// hold none has no count: 0 beside them would be wrong); it returns the
// error text if they could not answer.
func addClusterCounts(ctx context.Context, counter pubsub.LeaseCounter, stats []principalStat) string {
	names := make([]string, len(stats))
	for i, p := range stats {
		names[i] = p.Principal
	}
	names = counter.Holders(names)
	if len(names) == 0 {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, clusterCountTimeout)
	defer cancel()
	counts, err := countsWithin(ctx, counter, names)
	if err != nil {
		return err.Error()
	}
	for i := range stats {
		if n, ok := counts[stats[i].Principal]; ok {
			stats[i].ClusterStreams = &n
		}
	}
	return ""
}

// countsWithin asks for the counts until ctx ends. go-redis waits out its
// read timeout (5 s by default) on a Redis that hangs, whatever the
// context says: the stats answer in time with what this instance knows,
// and the question ends on its own.
func countsWithin(ctx context.Context, counter pubsub.LeaseCounter, names []string) (map[string]int, error) {
	type answer struct {
		counts map[string]int
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		counts, err := counter.Counts(ctx, names)
		done <- answer{counts, err}
	}()
	select {
	case a := <-done:
		return a.counts, a.err
	case <-ctx.Done():
		return nil, fmt.Errorf("counting leases: %w", ctx.Err())
	}
}

// Interface guards
var _ caddy.AdminRouter = AdminStats{}
