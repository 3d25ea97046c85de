package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// lookupFunc resolves a host name to addresses (net.DefaultResolver's
// LookupNetIP in the tool, a stub in tests).
type lookupFunc func(ctx context.Context, host string) ([]netip.Addr, error)

func defaultLookup(ctx context.Context, host string) ([]netip.Addr, error) {
	return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
}

// isLoopback reports whether a is in 127.0.0.0/8 or is ::1 (an IPv4-mapped
// 127.x address counts as IPv4).
func isLoopback(a netip.Addr) bool {
	a = a.Unmap()
	if a.Is4() {
		return a.As4()[0] == 127
	}
	return a == netip.IPv6Loopback()
}

// checkLoopbackHost refuses a host unless every address it resolves to is a
// loopback address. A literal address is not resolved.
func checkLoopbackHost(ctx context.Context, host string, lookup lookupFunc) ([]netip.Addr, error) {
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if host == "" {
		return nil, fmt.Errorf("empty host: refusing (loopback targets only)")
	}
	if i := strings.IndexByte(host, '%'); i >= 0 { // zone
		host = host[:i]
	}
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		if addrs, err = lookup(ctx, host); err != nil {
			return nil, fmt.Errorf("resolving %q: %v (loopback targets only)", host, err)
		}
		if len(addrs) == 0 {
			return nil, fmt.Errorf("%q resolves to no address (loopback targets only)", host)
		}
	}
	for _, a := range addrs {
		if !isLoopback(a) {
			return nil, fmt.Errorf("%q resolves to %s, which is not a loopback address: refusing (this tool only loads 127.0.0.0/8 and ::1)", host, a)
		}
	}
	return addrs, nil
}

// checkLoopbackURL parses an http(s) URL and checks its host.
func checkLoopbackURL(ctx context.Context, raw string, lookup lookupFunc) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("url %q: %v", raw, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("url %q: scheme must be http or https", raw)
	}
	if _, err := checkLoopbackHost(ctx, u.Hostname(), lookup); err != nil {
		return nil, fmt.Errorf("url %q: %v", raw, err)
	}
	return u, nil
}

// checkLoopbackAddr checks a host:port address (the admin endpoint).
func checkLoopbackAddr(ctx context.Context, hostport string, lookup lookupFunc) error {
	_, err := loopbackAddrPort(ctx, hostport, lookup)
	return err
}

// loopbackAddrPort checks a host:port address and returns the (first)
// loopback address it resolves to, with the port.
func loopbackAddrPort(ctx context.Context, hostport string, lookup lookupFunc) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: %v", hostport, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: bad port", hostport)
	}
	addrs, err := checkLoopbackHost(ctx, host, lookup)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return netip.AddrPortFrom(addrs[0].Unmap(), uint16(p)), nil
}

// adminClient returns a client for requests to the admin endpoint admin
// (host:port). The endpoint was checked to be loopback, but what answers
// there may redirect the tool (and the POSTed config of a reload) anywhere,
// and a name may resolve elsewhere later: the client follows no redirect
// (the caller sees the 3xx), uses no proxy, and dials only the loopback
// address admin resolves to now, after the check. It keeps no idle
// connection: the admin requests are few.
func adminClient(ctx context.Context, admin string) (*http.Client, error) {
	addr, err := loopbackAddrPort(ctx, admin, defaultLookup)
	if err != nil {
		return nil, fmt.Errorf("-admin: %v", err)
	}
	var dialer net.Dialer
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr.String())
		},
		DisableKeepAlives: true,
	}
	return &http.Client{
		Transport:     tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}, nil
}

// adminDo sends req to the admin endpoint admin through an adminClient.
func adminDo(admin string, req *http.Request) (*http.Response, error) {
	hc, err := adminClient(req.Context(), admin)
	if err != nil {
		return nil, err
	}
	return hc.Do(req)
}

// parseSourceRange parses "127.0.0.2-127.0.0.255" (or one address) into the
// source addresses to spread connections over; all must be IPv4 loopback.
func parseSourceRange(s string) ([]netip.Addr, error) {
	if s == "" {
		return nil, nil
	}
	from, to, found := strings.Cut(s, "-")
	a, err := netip.ParseAddr(strings.TrimSpace(from))
	if err != nil {
		return nil, fmt.Errorf("source range %q: %v", s, err)
	}
	b := a
	if found {
		if b, err = netip.ParseAddr(strings.TrimSpace(to)); err != nil {
			return nil, fmt.Errorf("source range %q: %v", s, err)
		}
	}
	if !a.Is4() || !b.Is4() || !isLoopback(a) || !isLoopback(b) || b.Less(a) {
		return nil, fmt.Errorf("source range %q: want IPv4 loopback addresses, low-high", s)
	}
	var out []netip.Addr
	for x := a; ; x = x.Next() {
		out = append(out, x)
		if x == b || len(out) > 1<<24 {
			break
		}
	}
	return out, nil
}
