package fencedlease

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// fakeSidecar serves the sidecar's /v1 API from a status the test sets, with an event stream
// that sends the status at once and then every change, like the real one.
type fakeSidecar struct {
	mu       sync.Mutex
	st       Status
	subs     map[chan Status]chan struct{} // stream -> closed to drop it
	releases int
	acked    []Token // acknowledgements received
	streams  int     // watch connections accepted
	srv      *httptest.Server
	client   *Client
	// secretFile holds fakeSecret; client reads it.
	secretFile string
}

func ptr[T any](v T) *T { return &v }

func leadingStatus(token int64, uid string, left time.Duration) Status {
	return Status{Lease: "db", Namespace: "ns", Identity: "pod-a", Leading: true, Token: ptr(token),
		LeaseUID: ptr(uid), Holder: ptr("pod-a"), TimeLeftMs: ptr(uint64(left / time.Millisecond)), AppHealthy: true}
}

func followingStatus(holder string) Status {
	st := Status{Lease: "db", Namespace: "ns", Identity: "pod-a", AppHealthy: true}
	if holder != "" {
		st.Holder = ptr(holder)
	}
	return st
}

func newFakeSidecar(t *testing.T, st Status) *fakeSidecar {
	t.Helper()
	f := &fakeSidecar{st: st, subs: map[chan Status]chan struct{}{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, f.status())
	})
	mux.HandleFunc("GET /v1/token", func(w http.ResponseWriter, r *http.Request) {
		st := f.status()
		if tok, ok := st.LeadingToken(); ok {
			writeJSON(w, http.StatusOK, tok)
			return
		}
		writeJSON(w, http.StatusConflict, map[string]any{"error": "not leading", "holder": st.Holder})
	})
	mux.HandleFunc("POST /v1/acknowledge", func(w http.ResponseWriter, r *http.Request) {
		var ack struct {
			Token    int64  `json:"token"`
			LeaseUID string `json:"leaseUID"`
		}
		if err := json.NewDecoder(r.Body).Decode(&ack); err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		tok, ok := f.status().LeadingToken()
		if !ok || tok != (Token{Value: ack.Token, LeaseUID: ack.LeaseUID}) {
			writeJSON(w, http.StatusConflict, map[string]string{"error": "not the current tenure"})
			return
		}
		f.mu.Lock()
		f.acked = append(f.acked, tok)
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"acknowledged": tok.Value})
	})
	mux.HandleFunc("POST /v1/release", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.releases++
		f.mu.Unlock()
		writeJSON(w, http.StatusAccepted, map[string]bool{"releasing": true})
	})
	mux.HandleFunc("GET /v1/watch", func(w http.ResponseWriter, r *http.Request) {
		ch, drop := make(chan Status, 16), make(chan struct{})
		f.mu.Lock()
		f.subs[ch] = drop
		f.streams++
		cur := f.st
		f.mu.Unlock()
		defer func() {
			f.mu.Lock()
			delete(f.subs, ch)
			f.mu.Unlock()
		}()
		w.Header().Set("Content-Type", "text/event-stream")
		send := func(st Status) {
			b, _ := json.Marshal(st)
			fmt.Fprintf(w, "event: status\ndata: %s\n\n", b)
			w.(http.Flusher).Flush()
		}
		send(cur)
		for {
			select {
			case st := <-ch:
				send(st)
			case <-drop:
				return
			case <-r.Context().Done():
				return
			}
		}
	})
	// Like the real sidecar: only requests with the pod's secret get through.
	f.secretFile = filepath.Join(t.TempDir(), "api-secret")
	if err := os.WriteFile(f.secretFile, []byte(fakeSecret+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+fakeSecret {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "send the contents of api-secret"})
			return
		}
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(f.close)
	c, err := NewClient(f.srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	c.SecretFile = f.secretFile
	f.client = c
	return f
}

// fakeSecret is the fake sidecar's API secret.
const fakeSecret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func (f *fakeSidecar) close() {
	f.dropStreams()
	f.srv.Close()
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func (f *fakeSidecar) status() Status {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.st
}

// set changes the status and tells every open stream.
func (f *fakeSidecar) set(st Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.st = st
	for ch := range f.subs {
		ch <- st
	}
}

// setQuietly changes the status without telling the streams (a sidecar whose stream is stuck).
func (f *fakeSidecar) setQuietly(st Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.st = st
}

// dropStreams ends every open event stream (as a sidecar restart does).
func (f *fakeSidecar) dropStreams() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for ch, drop := range f.subs {
		close(drop)
		delete(f.subs, ch)
	}
}

func (f *fakeSidecar) counts() (releases, streams int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.releases, f.streams
}

// waitFor polls cond every 10 ms for up to d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
