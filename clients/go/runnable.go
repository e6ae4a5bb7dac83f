package fencedlease

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrLeadershipLost is the cause (context.Cause) of a [Runnable]'s Run context when it was
// cancelled because this pod no longer leads, or can no longer tell that it does.
var ErrLeadershipLost = errors.New("fencedlease: leadership lost")

// statusCheckTimeout bounds the status request a Runnable makes when the validity it was told
// of runs out without news from the stream.
const statusCheckTimeout = 2 * time.Second

// Runnable runs Run only while this pod leads, and cancels Run's context as soon as it does not:
// when the sidecar says so, when its event stream breaks (leadership is then unknown), and when
// the validity the sidecar announced runs out and a fresh status does not confirm the same
// token (a frozen sidecar sends nothing). Run is called again, with the new token, each time
// this pod starts to lead again (or after the stream broke and came back); a new call starts
// only after the previous one returned.
//
// Its methods are those of controller-runtime's manager.Runnable and LeaderElectionRunnable
// (Go interfaces are structural: no import needed), so a manager takes it as it is:
//
//	mgr.Add(&fencedlease.Runnable{Client: sidecar, Run: func(ctx context.Context, tok fencedlease.Token) error {
//		<-ctx.Done() // work here while leading; return when ctx is done
//		return nil
//	}})
//
// NeedLeaderElection is false: the manager starts it on every replica, without
// controller-runtime's own election, and fencedlease's election (with a token the webhook
// checks) decides where Run runs.
type Runnable struct {
	// Client is the sidecar to follow.
	Client *Client
	// Run does the leader's work with this term's token. It must return soon after ctx is
	// cancelled (context.Cause(ctx) is then ErrLeadershipLost, or the manager's cause). Returning
	// nil ends the work for this term; returning an error while still leading makes Start
	// return it (a manager then stops).
	Run func(ctx context.Context, tok Token) error
}

// NeedLeaderElection is false: fencedlease elects, not the manager (see [Runnable]).
func (r *Runnable) NeedLeaderElection() bool { return false }

type watchItem struct {
	st  Status
	err error
}

// term is one run of Run, for one token.
type term struct {
	tok    Token
	cancel context.CancelCauseFunc
	done   chan error
}

// Start follows the sidecar until ctx is done, then cancels Run, waits for it and returns nil.
// It returns early with an error when the Runnable is misconfigured or Run failed while
// leading.
func (r *Runnable) Start(ctx context.Context) error {
	if r.Client == nil || r.Run == nil {
		return errors.New("fencedlease: Runnable needs Client (fencedlease.NewClient) and Run")
	}
	wctx, wcancel := context.WithCancel(ctx)
	events := make(chan watchItem)
	go func() {
		defer close(events)
		for st, err := range r.Client.Watch(wctx) {
			select {
			case events <- watchItem{st, err}:
			case <-wctx.Done():
				return
			}
		}
	}()
	defer func() {
		wcancel()
		for range events {
			// drain until the watcher is gone
		}
	}()

	var cur *term
	var finished *Token // the token whose Run returned nil: not run again in that term
	deadline := time.NewTimer(time.Hour)
	deadline.Stop()
	defer deadline.Stop()
	arm := func(st Status) {
		left := time.Second // a leading status without time left: check again soon
		if st.TimeLeftMs != nil {
			left = time.Duration(*st.TimeLeftMs) * time.Millisecond
		}
		deadline.Reset(left)
	}
	stop := func(why string) {
		if cur == nil {
			return
		}
		deadline.Stop()
		cur.cancel(fmt.Errorf("%w: %s", ErrLeadershipLost, why))
		<-cur.done
		cur = nil
	}
	// observe acts on a status: start, keep or stop the term.
	observe := func(st Status) {
		tok, leading := st.LeadingToken()
		switch {
		case !leading:
			stop("the sidecar says this pod does not lead (holder " + fmt.Sprintf("%q", st.HolderName()) + ")")
			finished = nil
		case cur != nil && cur.tok == tok:
			arm(st)
		case finished != nil && *finished == tok:
			// Run already returned in this term.
		default:
			stop("leadership moved to a new token")
			// The term's writes are pinned to its token, and the sidecar's proxy is told
			// that the app knows the tenure. A failed acknowledgement needs no handling here:
			// the proxy then refuses unpinned writes, saying why (fail closed), and writes
			// through the Transport do not depend on it.
			actx, acancel := context.WithTimeout(ctx, statusCheckTimeout)
			_ = r.Client.Acknowledge(actx, tok)
			acancel()
			runCtx, cancel := context.WithCancelCause(WithTenure(ctx, tok))
			t := &term{tok: tok, cancel: cancel, done: make(chan error, 1)}
			go func() { t.done <- r.Run(runCtx, tok) }()
			cur = t
			arm(st)
		}
	}
	for {
		var done chan error
		if cur != nil {
			done = cur.done
		}
		select {
		case it, ok := <-events:
			if !ok { // ctx is done
				stop("the Runnable is stopping")
				return nil
			}
			if it.err != nil {
				stop(it.err.Error())
				continue
			}
			observe(it.st)
		case <-deadline.C:
			cctx, cancel := context.WithTimeout(ctx, statusCheckTimeout)
			st, err := r.Client.Status(cctx)
			cancel()
			if err != nil {
				stop("the announced validity ran out and the status could not be checked: " + err.Error())
				continue
			}
			if tok, ok := st.LeadingToken(); !ok || cur == nil || tok != cur.tok {
				stop("the announced validity ran out and the sidecar no longer confirms this token")
			}
			observe(st)
		case err := <-done:
			t := cur
			cur = nil
			deadline.Stop()
			if err != nil && ctx.Err() == nil {
				return fmt.Errorf("fencedlease: Run failed while leading with token %s: %w", t.tok, err)
			}
			tok := t.tok
			finished = &tok
		}
	}
}
