package fencedlease

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// runLog records the Runnable's calls of Run: the token of each and how its context ended.
type runLog struct {
	mu      sync.Mutex
	started []Token
	causes  []error
	running int
	overlap bool
}

func (l *runLog) run(ctx context.Context, tok Token) error {
	l.mu.Lock()
	l.started = append(l.started, tok)
	l.running++
	if l.running > 1 {
		l.overlap = true
	}
	l.mu.Unlock()
	<-ctx.Done()
	time.Sleep(20 * time.Millisecond) // winding down takes a moment
	l.mu.Lock()
	l.running--
	l.causes = append(l.causes, context.Cause(ctx))
	l.mu.Unlock()
	return ctx.Err()
}

func (l *runLog) snapshot() (started []Token, causes []error, running int, overlap bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Token(nil), l.started...), append([]error(nil), l.causes...), l.running, l.overlap
}

// startRunnable runs r.Start until the test ends; the channel gets Start's result.
func startRunnable(t *testing.T, r *Runnable) (context.CancelFunc, chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() { done <- r.Start(ctx); close(finished) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(5 * time.Second):
			t.Error("Start did not return after its context was cancelled")
		}
	})
	return cancel, done
}

func TestRunnableHasTheMethodsOfControllerRuntimesRunnables(t *testing.T) {
	// controller-runtime's manager.Runnable and manager.LeaderElectionRunnable, spelled out.
	var _ interface {
		Start(context.Context) error
		NeedLeaderElection() bool
	} = &Runnable{}
	if (&Runnable{}).NeedLeaderElection() {
		t.Fatal("the manager's own election must not gate it: fencedlease elects")
	}
}

func TestRunnableRunsOnlyWhileLeadingAndCancelsOnLoss(t *testing.T) {
	f := newFakeSidecar(t, followingStatus("pod-b"))
	var log runLog
	cancel, done := startRunnable(t, &Runnable{Client: f.client, Run: log.run})
	time.Sleep(100 * time.Millisecond)
	if started, _, _, _ := log.snapshot(); len(started) != 0 {
		t.Fatalf("Run started while following: %v", started)
	}
	f.set(leadingStatus(5, "u", 10*time.Second))
	waitFor(t, 2*time.Second, "Run to start", func() bool { _, _, n, _ := log.snapshot(); return n == 1 })
	f.set(followingStatus("pod-b"))
	waitFor(t, 2*time.Second, "Run to be cancelled", func() bool { _, c, _, _ := log.snapshot(); return len(c) == 1 })
	_, causes, _, _ := log.snapshot()
	if !errors.Is(causes[0], ErrLeadershipLost) || !strings.Contains(causes[0].Error(), "does not lead") {
		t.Fatalf("cause %v", causes[0])
	}
	// Leading again: a new Run with the new token. Then a jump straight to another token
	// (a missed loss): the old Run ends before the new one starts.
	f.set(leadingStatus(7, "u", 10*time.Second))
	waitFor(t, 2*time.Second, "the second Run", func() bool { s, _, n, _ := log.snapshot(); return len(s) == 2 && n == 1 })
	f.set(leadingStatus(9, "u", 10*time.Second))
	waitFor(t, 2*time.Second, "the third Run", func() bool { s, _, n, _ := log.snapshot(); return len(s) == 3 && n == 1 })
	started, _, _, overlap := log.snapshot()
	if started[0].Value != 5 || started[1].Value != 7 || started[2].Value != 9 || overlap {
		t.Fatalf("started %v, overlap %v", started, overlap)
	}
	// Stopping the Runnable stops Run, and Start returns nil.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		if _, _, n, _ := log.snapshot(); n != 0 {
			t.Fatal("Start returned while Run still ran")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Start did not return")
	}
}

func TestRunnableCancelsWhenTheStreamBreaks(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(5, "u", 10*time.Second))
	var log runLog
	startRunnable(t, &Runnable{Client: f.client, Run: log.run})
	waitFor(t, 2*time.Second, "Run to start", func() bool { _, _, n, _ := log.snapshot(); return n == 1 })
	f.dropStreams()
	waitFor(t, 2*time.Second, "Run to be cancelled", func() bool { _, c, _, _ := log.snapshot(); return len(c) == 1 })
	_, causes, _, _ := log.snapshot()
	if !errors.Is(causes[0], ErrLeadershipLost) || !strings.Contains(causes[0].Error(), "stream broke") {
		t.Fatalf("cause %v", causes[0])
	}
	// Reconnected, still leading: Run again.
	waitFor(t, 3*time.Second, "Run to start again", func() bool { s, _, n, _ := log.snapshot(); return len(s) == 2 && n == 1 })
}

// A frozen sidecar sends nothing: when the validity it announced runs out, the Runnable asks
// for the status, and stops Run unless the same token is confirmed.
func TestRunnableStopsWhenTheAnnouncedValidityRunsOutUnconfirmed(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(5, "u", 300*time.Millisecond))
	var log runLog
	startRunnable(t, &Runnable{Client: f.client, Run: log.run})
	waitFor(t, 2*time.Second, "Run to start", func() bool { _, _, n, _ := log.snapshot(); return n == 1 })
	// Renewed (the status confirms the token with more time left): Run goes on.
	f.setQuietly(leadingStatus(5, "u", 300*time.Millisecond))
	time.Sleep(700 * time.Millisecond)
	if _, c, n, _ := log.snapshot(); n != 1 || len(c) != 0 {
		t.Fatalf("a confirmed token must keep Run running: running %d, causes %v", n, c)
	}
	// Not renewed, and the stream says nothing.
	f.setQuietly(followingStatus("pod-b"))
	start := time.Now()
	waitFor(t, 2*time.Second, "Run to be cancelled", func() bool { _, c, _, _ := log.snapshot(); return len(c) == 1 })
	if d := time.Since(start); d > time.Second {
		t.Fatalf("cancelled %v after the validity ran out", d)
	}
	_, causes, _, _ := log.snapshot()
	if !errors.Is(causes[0], ErrLeadershipLost) || !strings.Contains(causes[0].Error(), "validity ran out") {
		t.Fatalf("cause %v", causes[0])
	}
}

func TestRunnableReturnsRunsErrorAndDoesNotRerunAFinishedTerm(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(5, "u", 10*time.Second))
	var mu sync.Mutex
	calls := 0
	fail := false
	r := &Runnable{Client: f.client, Run: func(ctx context.Context, tok Token) error {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if fail {
			return errors.New("disk full")
		}
		return nil // done for this term
	}}
	_, done := startRunnable(t, r)
	waitFor(t, 2*time.Second, "Run", func() bool { mu.Lock(); defer mu.Unlock(); return calls == 1 })
	f.set(leadingStatus(5, "u", 9*time.Second)) // the same term: not run again
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	if calls != 1 {
		t.Fatalf("Run ran %d times in one term", calls)
	}
	fail = true
	mu.Unlock()
	f.set(leadingStatus(6, "u", 9*time.Second))
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "disk full") || !strings.Contains(err.Error(), "token 6") {
			t.Fatalf("Start: %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Start did not return Run's error")
	}
}

func TestRunnableNeedsClientAndRun(t *testing.T) {
	if err := (&Runnable{}).Start(context.Background()); err == nil || !strings.Contains(err.Error(), "NewClient") {
		t.Fatalf("%v", err)
	}
}

// Each term acknowledges its tenure with the sidecar and gives Run a context pinned to it.
func TestRunnablePinsEachTermAndAcknowledgesIt(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(7, "u1", time.Minute))
	pinned := make(chan Token, 1)
	r := &Runnable{Client: f.client, Run: func(ctx context.Context, tok Token) error {
		p, _ := TenureOf(ctx)
		pinned <- p
		<-ctx.Done()
		return nil
	}}
	startRunnable(t, r)
	select {
	case p := <-pinned:
		if p != (Token{Value: 7, LeaseUID: "u1"}) {
			t.Fatalf("Run's context is pinned to %v", p)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run never started")
	}
	f.mu.Lock()
	acked := append([]Token(nil), f.acked...)
	f.mu.Unlock()
	if len(acked) != 1 || acked[0].Value != 7 {
		t.Fatalf("acknowledged: %v", acked)
	}
}
