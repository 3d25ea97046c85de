//go:build !linux

// Package uring sends on (or reads from) many sockets with one system
// call, through io_uring; it is Linux-only, and New fails elsewhere.
package uring

import "errors"

// IO is one queued send or receive.
type IO struct {
	FD   int
	Buf  []byte
	Recv bool
}

// Ring is unavailable on this system.
type Ring struct{}

// New fails: io_uring is Linux-only.
func New(entries uint32) (*Ring, error) { return nil, errors.New("io_uring is Linux-only") }

// Entries is 0.
func (r *Ring) Entries() int { return 0 }

// KeepProcessor does nothing here.
func (r *Ring) KeepProcessor() {}

// Submit fails.
func (r *Ring) Submit(ios []IO, done func(i int, n int, err error)) error {
	return errors.New("io_uring is Linux-only")
}

// Close does nothing.
func (r *Ring) Close() {}
