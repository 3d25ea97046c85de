package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
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
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return fmt.Errorf("address %q: %v", hostport, err)
	}
	_, err = checkLoopbackHost(ctx, host, lookup)
	return err
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
