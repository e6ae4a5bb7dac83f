//go:build !linux

package fencedkube

import "time"

var start = time.Now()

// boottime is the monotonic time since the package was loaded (outside Linux there is no
// CLOCK_BOOTTIME; Kubernetes nodes run Linux).
func boottime() time.Duration { return time.Since(start) }
