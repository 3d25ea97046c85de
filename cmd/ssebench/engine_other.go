//go:build !linux

package main

import "errors"

func openEpollEngine(opts engineOpts) (engine, error) {
	return nil, errors.New("the epoll engine needs Linux; use -engine std")
}
