package fencedkube

import (
	"time"

	"golang.org/x/sys/unix"
)

// boottime is CLOCK_BOOTTIME: monotonic, and time spent suspended counts (Go's own monotonic
// clock stops during a suspend, and a tenure must not outlive one).
func boottime() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return time.Duration(time.Now().UnixNano()) // not expected on Linux
	}
	return time.Duration(ts.Nano())
}
