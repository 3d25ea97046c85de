//go:build !linux

package main

import "syscall"

func spawnAttrs() *syscall.SysProcAttr { return nil }
