//go:build !linux

// Package uring sends on many sockets with one system call, through
// io_uring; it is Linux-only, and New fails elsewhere.
package uring

import "errors"

// Send is one queued send.
type Send struct {
	FD   int
	Data []byte
}

// Ring is unavailable on this system.
type Ring struct{}

// New fails: io_uring is Linux-only.
func New(entries uint32) (*Ring, error) { return nil, errors.New("io_uring is Linux-only") }

// Entries is 0.
func (r *Ring) Entries() int { return 0 }

// Submit fails.
func (r *Ring) Submit(sends []Send, done func(i int, n int, err error)) error {
	return errors.New("io_uring is Linux-only")
}

// Close does nothing.
func (r *Ring) Close() {}
