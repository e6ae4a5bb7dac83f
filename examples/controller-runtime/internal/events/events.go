// Package events prints the sample's events, one JSON line each on stdout, for the
// repository's test (tests/adoption_controller_runtime.rs) to read.
package events

import (
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

var mu sync.Mutex

// Emit prints one event of identity.
func Emit(identity, event string, fields map[string]any) {
	line := map[string]any{"t_ns": time.Now().UnixNano(), "identity": identity, "event": event}
	for k, v := range fields {
		line[k] = v
	}
	b, err := json.Marshal(line)
	if err != nil {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	fmt.Println(string(b))
}
