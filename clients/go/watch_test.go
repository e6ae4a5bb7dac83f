package fencedlease

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// events reads every event of stream; the error that ended it (nil for a clean end).
func readEvents(r io.Reader) ([]sseEvent, *sseReader, error) {
	sr := newSSEReader(r, nil)
	var out []sseEvent
	for {
		ev, err := sr.next()
		if err == io.EOF {
			return out, sr, nil
		}
		if err != nil {
			return out, sr, err
		}
		out = append(out, ev)
	}
}

func TestSSEParsing(t *testing.T) {
	type ev = sseEvent
	for _, tc := range []struct {
		name, in string
		want     []ev
	}{
		{"lf", "event: status\ndata: {}\n\n", []ev{{"status", []byte("{}")}}},
		{"crlf", "event: status\r\ndata: {}\r\n\r\n", []ev{{"status", []byte("{}")}}},
		{"cr", "event: status\rdata: {}\r\r", []ev{{"status", []byte("{}")}}},
		{"mixed line ends", "event: a\r\ndata: 1\rdata: 2\n\r\n", []ev{{"a", []byte("1\n2")}}},
		{"multi-line data joined with LF", "data: {\ndata: \"x\":1\ndata: }\n\n", []ev{{"message", []byte("{\n\"x\":1\n}")}}},
		{"no event name is message", "data: x\n\n", []ev{{"message", []byte("x")}}},
		{"comments and keep-alives skipped", ":\n: keep-alive\nevent: status\n:mid\ndata: x\n\n:\n\n", []ev{{"status", []byte("x")}}},
		{"no space after colon", "event:status\ndata:x\n\n", []ev{{"status", []byte("x")}}},
		{"only one space dropped", "data:  x \n\n", []ev{{"message", []byte(" x ")}}},
		{"field without colon", "data\n\n", []ev{{"message", []byte("")}}},
		{"colon in value kept", "data: a:b: c\n\n", []ev{{"message", []byte("a:b: c")}}},
		{"BOM at start dropped", "\xef\xbb\xbfevent: status\ndata: x\n\n", []ev{{"status", []byte("x")}}},
		{"BOM later is data", "data: \xef\xbb\xbfx\n\n", []ev{{"message", []byte("\xef\xbb\xbfx")}}},
		{"event without data not dispatched, its name forgotten", "event: a\n\ndata: x\n\n", []ev{{"message", []byte("x")}}},
		{"name reset after dispatch", "event: a\ndata: 1\n\ndata: 2\n\n", []ev{{"a", []byte("1")}, {"message", []byte("2")}}},
		{"unknown fields and id ignored", "id: 7\nfoo: bar\nevent: status\ndata: x\n\n", []ev{{"status", []byte("x")}}},
		{"unterminated last event discarded", "data: 1\n\ndata: 2\n", []ev{{"message", []byte("1")}}},
		{"unterminated last line discarded", "data: 1\n\ndata: 2", []ev{{"message", []byte("1")}}},
		{"blank lines between events", "\n\n\r\ndata: 1\n\n\n\ndata: 2\n\n", []ev{{"message", []byte("1")}, {"message", []byte("2")}}},
		{"empty stream", "", nil},
	} {
		for _, mode := range []string{"whole", "byte by byte"} {
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				var r io.Reader = strings.NewReader(tc.in)
				if mode == "byte by byte" {
					r = iotest.OneByteReader(r) // a CRLF split across reads is one line end
				}
				got, _, err := readEvents(r)
				if err != nil {
					t.Fatal(err)
				}
				if fmt.Sprintf("%q", got) != fmt.Sprintf("%q", tc.want) {
					t.Fatalf("got %q, want %q", got, tc.want)
				}
			})
		}
	}
}

func TestSSERetryField(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"retry: 1500\n":  1500 * time.Millisecond,
		"retry: 15x\n":   0,
		"retry: +15\n":   0,
		"retry:\n":       0,
		"retry: -1\n":    0,
		"retry: 10\r\n":  10 * time.Millisecond,
		"retry: 99999\n": 99999 * time.Millisecond,
	} {
		_, sr, err := readEvents(strings.NewReader(in))
		if err != nil || sr.retry != want {
			t.Errorf("%q: retry %v (%v), want %v", in, sr.retry, err, want)
		}
	}
}

func TestSSEBoundsLinesAndEvents(t *testing.T) {
	long := "data: " + strings.Repeat("x", maxEventBytes) + "\n\n"
	if _, _, err := readEvents(strings.NewReader(long)); !errors.Is(err, errEventTooLarge) {
		t.Fatalf("a long line: %v", err)
	}
	many := strings.Repeat("data: "+strings.Repeat("x", 1000)+"\n", maxEventBytes/1000+1) + "\n"
	if _, _, err := readEvents(strings.NewReader(many)); !errors.Is(err, errEventTooLarge) {
		t.Fatalf("many data lines: %v", err)
	}
	// Keep-alives alone never grow anything.
	keepAlives := strings.Repeat(":\n", 100000) + "data: x\n\n"
	got, _, err := readEvents(strings.NewReader(keepAlives))
	if err != nil || len(got) != 1 {
		t.Fatalf("keep-alives: %q %v", got, err)
	}
}

// next pulls one (status, error) from a running watch, or fails after d.
func next(t *testing.T, pull func() (Status, error, bool), d time.Duration) (Status, error) {
	t.Helper()
	type r struct {
		st  Status
		err error
		ok  bool
	}
	ch := make(chan r, 1)
	go func() { st, err, ok := pull(); ch <- r{st, err, ok} }()
	select {
	case got := <-ch:
		if !got.ok {
			t.Fatal("the watch ended")
		}
		return got.st, got.err
	case <-time.After(d):
		t.Fatalf("nothing from the watch within %v", d)
		return Status{}, nil
	}
}

func TestWatchFollowsChangesAndReconnectsWithTheCurrentStatus(t *testing.T) {
	f := newFakeSidecar(t, followingStatus("pod-b"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pull, stop := iterPull(f.client.Watch(ctx))
	defer stop()
	st, err := next(t, pull, 2*time.Second)
	if err != nil || st.Leading || st.HolderName() != "pod-b" {
		t.Fatalf("first: %+v %v", st, err)
	}
	f.set(leadingStatus(8, "u", 5*time.Second))
	st, err = next(t, pull, 2*time.Second)
	if tok, ok := st.LeadingToken(); err != nil || !ok || tok.Value != 8 {
		t.Fatalf("second: %+v %v", st, err)
	}
	// The stream breaks; meanwhile leadership moves on. The watch says it broke, then
	// reconnects and starts with the status as it is now.
	f.dropStreams()
	_, err = next(t, pull, 2*time.Second)
	var we *WatchError
	if !errors.As(err, &we) || we.RetryIn != watchRetryFirst || !strings.Contains(err.Error(), "closed the stream") {
		t.Fatalf("want a WatchError after the first delay, got %v", err)
	}
	if !strings.Contains(err.Error(), "act as if this pod does not lead") {
		t.Fatalf("the error must say what to do: %v", err)
	}
	f.setQuietly(followingStatus("pod-c"))
	st, err = next(t, pull, 2*time.Second)
	if err != nil || st.Leading || st.HolderName() != "pod-c" {
		t.Fatalf("after reconnecting: %+v %v", st, err)
	}
	if _, streams := f.counts(); streams != 2 {
		t.Fatalf("streams: %d", streams)
	}
}

func TestWatchBacksOffWhileTheSidecarIsAway(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	c, err := NewClient(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var delays []time.Duration
	var errs []error
	for _, err := range c.Watch(ctx) {
		var we *WatchError
		if !errors.As(err, &we) {
			t.Fatalf("want only WatchErrors, got %v", err)
		}
		delays = append(delays, we.RetryIn)
		errs = append(errs, err)
		if len(delays) == 3 {
			srv.Close() // now nothing listens at all
		}
		if len(delays) == 4 {
			break // the consumer stops: the iterator must end without yielding again
		}
	}
	want := []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}
	if fmt.Sprint(delays) != fmt.Sprint(want) {
		t.Fatalf("delays %v, want %v", delays, want)
	}
	if !strings.Contains(errs[0].Error(), "not an event stream") || !strings.Contains(errs[0].Error(), "404") {
		t.Fatalf("a 404 must say so: %v", errs[0])
	}
	if !strings.Contains(errs[3].Error(), "does not answer") {
		t.Fatalf("an absent sidecar must say so: %v", errs[3])
	}
}

func TestWatchTakesASilentStreamForDead(t *testing.T) {
	// One status, then nothing at all, not even a keep-alive: a frozen sidecar.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "event: status\ndata: {\"leading\":false}\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	c, err := NewClient(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	c.WatchIdleTimeout = 200 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pull, stop := iterPull(c.Watch(ctx))
	defer stop()
	if _, err := next(t, pull, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = next(t, pull, 2*time.Second)
	if !errors.Is(err, errIdle) {
		t.Fatalf("want the idle error, got %v", err)
	}
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Fatalf("taken for dead after %v, before the idle timeout", d)
	}
}

func TestWatchKeepAlivesKeepAStreamAlive(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		fmt.Fprint(w, "event: status\ndata: {\"leading\":false}\n\n")
		w.(http.Flusher).Flush()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(50 * time.Millisecond):
				fmt.Fprint(w, ":\n\n")
				w.(http.Flusher).Flush()
			}
		}
	}))
	defer srv.Close()
	c, _ := NewClient(srv.URL)
	c.WatchIdleTimeout = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	n := 0
	for _, err := range c.Watch(ctx) {
		if err != nil {
			t.Fatalf("a stream with keep-alives broke: %v", err)
		}
		n++
	}
	if n != 1 {
		t.Fatalf("statuses: %d", n)
	}
}

func TestWatchSkipsOtherEventsAndBreaksOnABadStatus(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "event: hello\ndata: {}\n\nevent: status\ndata: {\"leading\":true,\"token\":3,\"leaseUID\":\"u\"}\n\nevent: status\ndata: [1]\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	c, _ := NewClient(srv.URL)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pull, stop := iterPull(c.Watch(ctx))
	defer stop()
	st, err := next(t, pull, 2*time.Second)
	if tok, ok := st.LeadingToken(); err != nil || !ok || tok.Value != 3 {
		t.Fatalf("%+v %v", st, err)
	}
	_, err = next(t, pull, 2*time.Second)
	var we *WatchError
	if !errors.As(err, &we) || !strings.Contains(err.Error(), "not a status") {
		t.Fatalf("want a WatchError for the bad status, got %v", err)
	}
}

func TestWatchEndsWhenTheContextIsDone(t *testing.T) {
	f := newFakeSidecar(t, followingStatus("pod-b"))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() {
		n := 0
		for range f.client.Watch(ctx) {
			n++
		}
		done <- n
	}()
	waitFor(t, 2*time.Second, "the stream", func() bool { _, s := f.counts(); return s == 1 })
	cancel()
	select {
	case n := <-done:
		if n != 1 {
			t.Fatalf("yielded %d, want only the first status (no error for the cancellation)", n)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the watch did not end with its context")
	}
}

func iterPull(s iter.Seq2[Status, error]) (func() (Status, error, bool), func()) {
	return iter.Pull2(s)
}
