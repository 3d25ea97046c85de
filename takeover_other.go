//go:build !linux

package caddysse

import (
	"crypto/tls"
	"net"
)

// loopSet has no event loops outside Linux: streams stay on net/http.
type loopSet struct{}

func newLoopSet() *loopSet { return &loopSet{} }

func (ls *loopSet) supported() bool { return false }

func (ls *loopSet) adopt(*stream, *net.TCPConn, *tls.Conn) bool { return false }

// Destruct does nothing.
func (ls *loopSet) Destruct() error { return nil }

// tconn is never created outside Linux.
type tconn struct{}

func (tk *tconn) schedule(*stream) {}

func (tk *tconn) blockedSince() int64 { return 0 }

func (ls *loopSet) sendsBy() string { return "" }
