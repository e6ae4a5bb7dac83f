package fencedlease

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"mime"
	"net/http"
	"strconv"
	"time"
)

const (
	// maxEventBytes bounds one line and one event of the event stream (a status is a few
	// hundred bytes).
	maxEventBytes = 64 << 10
	// DefaultWatchIdleTimeout: the sidecar sends a keep-alive comment every 15 s, so a stream
	// silent for this long is dead (a frozen sidecar, a half-open connection).
	DefaultWatchIdleTimeout = 45 * time.Second
	// Reconnect delays: the first, and the most it grows to (doubling after each failure, back
	// to the first once a connection delivers a status).
	watchRetryFirst = 250 * time.Millisecond
	watchRetryMax   = 5 * time.Second
)

// sseEvent is one dispatched Server-Sent Event.
type sseEvent struct {
	typ  string // "message" when the event named none
	data []byte
}

// sseReader parses a text/event-stream as the HTML standard says
// (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
// lines end in CRLF, LF or CR; a leading BOM is dropped; comments (":...") are skipped; a field
// without a colon has an empty value; one space after the colon is dropped; data lines are
// joined with LF; a blank line dispatches; an event not ended by a blank line when the stream
// ends is discarded. Lines and events are bounded in size.
type sseReader struct {
	sc      *bufio.Scanner
	started bool
	// retry is the last "retry:" the server sent (0 when none).
	retry time.Duration
	// seen is called on every line, comments (keep-alives) included.
	seen func()
}

func newSSEReader(r io.Reader, seen func()) *sseReader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxEventBytes)
	sc.Split(scanSSELines)
	if seen == nil {
		seen = func() {}
	}
	return &sseReader{sc: sc, seen: seen}
}

// scanSSELines splits at CRLF, LF or CR. A CR at the end of the buffer waits for the next
// byte, so that a CRLF split across two reads is one line end.
func scanSSELines(data []byte, atEOF bool) (int, []byte, error) {
	i := bytes.IndexAny(data, "\r\n")
	switch {
	case i < 0 && atEOF && len(data) > 0:
		return len(data), data, nil // unterminated last line
	case i < 0:
		return 0, nil, nil
	case data[i] == '\n':
		return i + 1, data[:i], nil
	case i+1 < len(data) && data[i+1] == '\n':
		return i + 2, data[:i], nil
	case i+1 < len(data) || atEOF:
		return i + 1, data[:i], nil
	default:
		return 0, nil, nil // a CR last: is an LF next?
	}
}

// errEventTooLarge is returned for a line or an event larger than maxEventBytes.
var errEventTooLarge = fmt.Errorf("an event of the stream is larger than %d bytes", maxEventBytes)

// next returns the next event; io.EOF when the stream ended cleanly.
func (r *sseReader) next() (sseEvent, error) {
	var typ string
	var data []byte
	hasData := false
	for r.sc.Scan() {
		r.seen()
		line := r.sc.Bytes()
		if !r.started {
			r.started = true
			line = bytes.TrimPrefix(line, []byte("\xef\xbb\xbf"))
		}
		if len(line) == 0 {
			if !hasData {
				typ = ""
				continue
			}
			if typ == "" {
				typ = "message"
			}
			return sseEvent{typ: typ, data: data}, nil
		}
		if line[0] == ':' {
			continue
		}
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			value = bytes.TrimPrefix(value, []byte(" "))
		}
		switch string(field) {
		case "event":
			typ = string(value)
		case "data":
			if hasData {
				data = append(data, '\n')
			}
			data = append(data, value...)
			hasData = true
			if len(data) > maxEventBytes {
				return sseEvent{}, errEventTooLarge
			}
		case "retry":
			if ms, err := strconv.ParseUint(string(value), 10, 32); err == nil && len(value) > 0 && value[0] != '+' {
				r.retry = time.Duration(ms) * time.Millisecond
			}
		}
		// "id" and unknown fields: nothing to do (the sidecar sends the whole status every
		// time, so there is no Last-Event-ID to resume from).
	}
	if err := r.sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return sseEvent{}, errEventTooLarge
		}
		return sseEvent{}, err
	}
	return sseEvent{}, io.EOF
}

// WatchError is what [Client.Watch] yields when its stream broke; it reconnects after
// RetryIn. Until the next status arrives this pod's leadership is unknown: stop acting as the
// leader.
type WatchError struct {
	Err     error
	RetryIn time.Duration
}

func (e *WatchError) Error() string {
	return fmt.Sprintf("fencedlease: the status stream broke (%v); reconnecting in %v. Until a status arrives again, act as if this pod does not lead", e.Err, e.RetryIn)
}

func (e *WatchError) Unwrap() error { return e.Err }

// Watch follows the sidecar's /v1/watch event stream. It yields the status at once, then one
// status per change (including the moment leadership runs out without a renewal; the time
// left alone changing is no change).
//
// It reconnects by itself: when the stream breaks (the sidecar restarted, the connection
// dropped, or nothing, not even a keep-alive, arrived for [Client.WatchIdleTimeout]) it yields
// a [*WatchError] and connects again after 250 ms, doubling up to 5 s while connecting fails
// (or after the server's "retry:" if it sent one). A new connection starts with the current
// status, so the latest state is never missed, though changes made while disconnected are
// seen only as their result. After an error, treat leadership as lost until a status says
// otherwise: the sidecar may have lost it meanwhile.
//
// It ends when ctx is done (without yielding ctx's error) or when the loop breaks.
func (c *Client) Watch(ctx context.Context) iter.Seq2[Status, error] {
	return func(yield func(Status, error) bool) {
		delay := watchRetryFirst
		for ctx.Err() == nil {
			delivered, retry, stopped, err := c.watchOnce(ctx, yield)
			if stopped || ctx.Err() != nil {
				return
			}
			if delivered {
				delay = watchRetryFirst
			}
			if retry > 0 {
				delay = min(retry, watchRetryMax)
			}
			if !yield(Status{}, &WatchError{Err: err, RetryIn: delay}) {
				return
			}
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			delay = min(delay*2, watchRetryMax)
		}
	}
}

// watchIdleTimeout is [Client.WatchIdleTimeout] or its default.
func (c *Client) watchIdleTimeout() time.Duration {
	if c.WatchIdleTimeout > 0 {
		return c.WatchIdleTimeout
	}
	return DefaultWatchIdleTimeout
}

var errIdle = errors.New("the stream was silent for too long (no status, no keep-alive)")

// watchOnce reads one connection's events. It returns whether a status was delivered, the
// server's retry delay, whether the consumer stopped, and why the stream ended.
func (c *Client) watchOnce(ctx context.Context, yield func(Status, error) bool) (delivered bool, retry time.Duration, stopped bool, err error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := c.watchIdleTimeout()
	timer := time.AfterFunc(idle, func() { cancel(errIdle) })
	defer timer.Stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.endpoint("/v1/watch"), nil)
	if err != nil {
		return false, 0, false, err
	}
	req.Header.Set("Accept", "text/event-stream")
	if err := c.authorize(req); err != nil {
		return false, 0, false, err
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		if cause := context.Cause(ctx); cause == errIdle {
			err = cause
		}
		return false, 0, false, c.unreachable("GET /v1/watch", err)
	}
	defer resp.Body.Close()
	ct, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode == http.StatusUnauthorized {
		body, _ := readBounded(resp.Body, 512)
		return false, 0, false, c.refused("GET /v1/watch", body)
	}
	if resp.StatusCode != http.StatusOK || ct != "text/event-stream" {
		body, _ := readBounded(resp.Body, 512)
		return false, 0, false, fmt.Errorf("GET /v1/watch answered %d (%s) %s, not an event stream: is %s a fencedlease sidecar?", resp.StatusCode, ct, excerpt(body), c.base)
	}
	r := newSSEReader(resp.Body, func() { timer.Reset(idle) })
	for {
		ev, err := r.next()
		if err != nil {
			if cause := context.Cause(ctx); cause == errIdle {
				err = cause
			} else if err == io.EOF {
				err = errors.New("the sidecar closed the stream")
			}
			return delivered, r.retry, false, err
		}
		if ev.typ != "status" {
			continue // kinds of events this client does not know
		}
		st, err := decodeStatus(ev.data)
		if err != nil {
			return delivered, r.retry, false, err
		}
		delivered = true
		if !yield(st, nil) {
			return delivered, r.retry, true, nil
		}
	}
}
