package main

import "time"

// result is the JSON line of a run.
type result struct {
	Scenario  string            `json:"scenario"`
	Label     string            `json:"label,omitempty"`
	Started   string            `json:"started"`
	OK        bool              `json:"ok"`
	Error     string            `json:"error,omitempty"`
	Engine    string            `json:"engine"`
	Proto     string            `json:"proto"`
	Targets   []string          `json:"targets"`
	PublishTo string            `json:"publish_url,omitempty"`
	Conns     int               `json:"conns"`
	Channels  int               `json:"channels"`
	PerConn   int               `json:"per_conn"`
	Rate      float64           `json:"rate,omitempty"`
	DurationS float64           `json:"duration_s,omitempty"`
	Workers   int               `json:"workers,omitempty"`
	Procs     int               `json:"procs,omitempty"`
	LoadStart string            `json:"loadavg_start"`
	LoadEnd   string            `json:"loadavg_end"`
	ElapsedS  float64           `json:"elapsed_s"`
	Ramp      *rampSummary      `json:"ramp,omitempty"`
	Server    *serverSummary    `json:"server,omitempty"`
	Redis     *redisSummary     `json:"redis,omitempty"`
	Client    *clientSummary    `json:"client,omitempty"`
	Delivery  *deliverySummary  `json:"delivery,omitempty"`
	Latency   *latencySummary   `json:"latency,omitempty"`
	Publish   *publishSummary   `json:"publish,omitempty"`
	Reconnect *reconnectSummary `json:"reconnect,omitempty"`
	Churn     *churnSummary     `json:"churn,omitempty"`
	Conn      *connSummary      `json:"connections,omitempty"`
	Box       *boxSummary       `json:"box,omitempty"`
	Errors    map[string]int64  `json:"errors,omitempty"`
	Chaos     []chaosEvent      `json:"chaos,omitempty"`
	Notes     []string          `json:"notes,omitempty"`
}

// boxSummary is the machine's CPU over the measured window: what the server
// and this tool used, and what other processes took (a contended run).
type boxSummary struct {
	Seconds     float64 `json:"seconds"`
	BusyCores   float64 `json:"busy_cores"`
	ServerCores float64 `json:"server_cores"`
	RedisCores  float64 `json:"redis_cores,omitempty"`
	ClientCores float64 `json:"client_cores"`
	// SoftirqCores is the kernel's softirq threads: network work of the
	// measured traffic that the kernel deferred (not counted in others).
	SoftirqCores float64 `json:"softirq_cores"`
	OtherCores   float64 `json:"other_cores"`
	// StealCores is what the hypervisor took from this machine's CPUs
	// (not in busy or others since the twenty-ninth session; in both
	// before): a slowed host, not other processes.
	StealCores float64 `json:"steal_cores"`
	Cores      int     `json:"cores"`
}

type rampSummary struct {
	Conns          int             `json:"conns"`
	Connected      int64           `json:"connected"`
	Failed         int64           `json:"failed_attempts"`
	GaveUp         int64           `json:"gave_up"`
	Seconds        float64         `json:"seconds"`
	ConnsPerS      float64         `json:"conns_per_s"`
	TimedOut       bool            `json:"timed_out,omitempty"`
	ConnectLatency *latencySummary `json:"connect_latency"`
	ServerCPUs     float64         `json:"server_cpu_s,omitempty"`
	ServerCPUPerUs float64         `json:"server_cpu_per_conn_us,omitempty"`
	ClientCPUs     float64         `json:"client_cpu_s"`
}

type serverSummary struct {
	PID              int     `json:"pid"`
	PIDs             []int   `json:"pids,omitempty"` // several servers: the figures below are sums
	RSSBaseKiB       int64   `json:"rss_base_kib"`
	RSSKiB           int64   `json:"rss_kib"`
	HWMKiB           int64   `json:"rss_peak_kib"`
	RSSPerConnKiB    float64 `json:"rss_per_conn_kib,omitempty"`
	CPUSeconds       float64 `json:"cpu_s"`
	CPUCores         float64 `json:"cpu_cores"`
	CPUPerDeliveryUs float64 `json:"cpu_per_delivery_us,omitempty"`
	// UserPerDeliveryUs is the part of CPUPerDeliveryUs spent in user
	// space (USER_HZ ticks: 10 ms each).
	UserPerDeliveryUs float64 `json:"cpu_user_per_delivery_us,omitempty"`
	Threads           int64   `json:"threads"`
	FDs               int     `json:"fds"`
	FDsBase           int     `json:"fds_base"`
	Goroutines        int     `json:"goroutines,omitempty"`
	// MemStats is the Go runtime's view (admin /debug/vars), in KiB.
	MemStats *memStats `json:"memstats_kib,omitempty"`
	// Processes are the servers one by one, when there are several.
	Processes []procSummary `json:"processes,omitempty"`
}

// procSummary is one process: a server, the Redis, or a subscriber worker.
type procSummary struct {
	PID        int     `json:"pid"`
	URL        string  `json:"url,omitempty"`
	Conns      int     `json:"conns,omitempty"`
	RSSBaseKiB int64   `json:"rss_base_kib,omitempty"`
	RSSKiB     int64   `json:"rss_kib"`
	HWMKiB     int64   `json:"rss_peak_kib"`
	CPUSeconds float64 `json:"cpu_s"`
	CPUCores   float64 `json:"cpu_cores,omitempty"`
	Threads    int64   `json:"threads,omitempty"`
	FDs        int     `json:"fds,omitempty"`
}

// redisSummary is the spawned redis-server over the measured window.
type redisSummary struct {
	URL string `json:"url"`
	procSummary
}

// memStats is the part of runtime.MemStats that explains an RSS, in KiB.
type memStats struct {
	HeapAlloc    int64   `json:"heap_alloc"`
	HeapInuse    int64   `json:"heap_inuse"`
	HeapIdle     int64   `json:"heap_idle_unreleased"`
	StackInuse   int64   `json:"stack_inuse"`
	MSpanInuse   int64   `json:"mspan_inuse"`
	GCSys        int64   `json:"gc_sys"`
	OtherSys     int64   `json:"other_sys"`
	Sys          int64   `json:"sys"`
	NumGC        int64   `json:"num_gc"`
	PerConnStack float64 `json:"stack_per_conn,omitempty"`
	PerConnHeap  float64 `json:"heap_inuse_per_conn,omitempty"`
}

type clientSummary struct {
	CPUSeconds       float64 `json:"cpu_s"`
	CPUCores         float64 `json:"cpu_cores"`
	CPUPerDeliveryUs float64 `json:"cpu_per_delivery_us,omitempty"`
	RSSKiB           int64   `json:"rss_kib"`
	Goroutines       int     `json:"goroutines"`
	// Procs are the subscriber workers (-procs; their CPU since they
	// started); the figures above include them.
	Procs []procSummary `json:"procs,omitempty"`
}

type deliverySummary struct {
	Clients      int     `json:"clients"`
	Expected     int64   `json:"expected"`
	Unique       int64   `json:"unique"`
	Received     int64   `json:"received"`
	Lost         int64   `json:"lost"`
	Dupes        int64   `json:"dupes"`
	Reordered    int64   `json:"reordered"`
	Extra        int64   `json:"extra,omitempty"`
	Foreign      int64   `json:"foreign,omitempty"`
	Unparsed     int64   `json:"unparsed,omitempty"`
	Truncated    int64   `json:"truncated_events,omitempty"`
	Closing      int64   `json:"server_closing,omitempty"`
	PerS         float64 `json:"per_s"`
	OverallPerS  float64 `json:"overall_per_s"`
	DrainSeconds float64 `json:"drain_s"`
	Drained      bool    `json:"drained"`
}

type reconnectSummary struct {
	Reload           string  `json:"reload"`
	ReloadSeconds    float64 `json:"reload_s"`
	AllReconnectedS  float64 `json:"all_reconnected_s"`
	AllEventsS       float64 `json:"all_events_s"`
	DoneS            float64 `json:"done_s"`
	BudgetS          float64 `json:"budget_s"`
	WithinBudget     bool    `json:"within_budget"`
	Clients          int     `json:"clients"`
	Reconnected      int     `json:"clients_reconnected"`
	Complete         int     `json:"clients_complete"`
	ServerClosing    int64   `json:"server_closing_events"`
	TruncatedReplays int64   `json:"truncated"`
}

type churnSummary struct {
	Scheduled       int64           `json:"scheduled"`
	Attempted       int64           `json:"attempted"`
	Connected       int64           `json:"connected"`
	Failed          int64           `json:"failed"`
	SkippedFDLimit  int64           `json:"skipped_fd_limit,omitempty"`
	Seconds         float64         `json:"seconds"`
	ConnsPerS       float64         `json:"conns_per_s"`
	PeakLive        int64           `json:"peak_live"`
	ConnectLatency  *latencySummary `json:"connect_latency"`
	ServerCPUPerCon float64         `json:"server_cpu_per_conn_us"`
}

type connSummary struct {
	Attempts      int64 `json:"attempts"`
	Connected     int64 `json:"connected"`
	Failed        int64 `json:"failed"`
	GaveUp        int64 `json:"gave_up"`
	Ended         int64 `json:"ended_by_server"`
	ClosedByUs    int64 `json:"closed_by_us"`
	Reconnects    int64 `json:"reconnects"`
	TruncatedHead int64 `json:"truncated_heads"`
	Dials         int64 `json:"dials,omitempty"`
	EpollWaits    int64 `json:"epoll_waits,omitempty"`
	ReadyEvents   int64 `json:"ready_events,omitempty"`
	Reads         int64 `json:"reads,omitempty"`
}

func newResult(cfg *config) *result {
	return &result{
		Scenario:  cfg.scenario,
		Label:     cfg.label,
		Started:   time.Now().UTC().Format(time.RFC3339),
		Proto:     cfg.proto,
		Conns:     cfg.conns,
		Channels:  cfg.channels,
		PerConn:   cfg.perConn,
		Rate:      cfg.rate,
		DurationS: cfg.duration.Seconds(),
		Procs:     cfg.procs,
		LoadStart: loadavg(),
	}
}
