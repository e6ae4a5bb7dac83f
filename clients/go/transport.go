package fencedlease

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
)

// The annotations every write to a protected object carries (README, "Protect what the leader
// writes"; the webhook's src/fencing.rs).
const (
	// LeaseLabel is the label naming the FencedLease (same namespace) that guards an object.
	LeaseLabel = "fencedlease.io/lease"
	// TokenAnnotation carries the writer's fencing token.
	TokenAnnotation = "fencedlease.io/token"
	// LeaseUIDAnnotation carries the UID of the lease the token belongs to.
	LeaseUIDAnnotation = "fencedlease.io/lease-uid"
	// WriteIDAnnotation carries a value new on every write: the proof that the write presents
	// its token itself rather than leaving the stored one in place.
	WriteIDAnnotation = "fencedlease.io/write-id"
)

// MaxStampBodyBytes is the largest request body the Transport reads to stamp it (the same
// bound as the sidecar's own API proxy).
const MaxStampBodyBytes = 8 << 20

// Transport is an http.RoundTripper for a Kubernetes API client. It adds the current token,
// the lease UID and a new write id (the annotations [TokenAnnotation], [LeaseUIDAnnotation],
// [WriteIDAnnotation]) to the JSON body of every create (POST), update (PUT), merge patch and
// strategic merge patch, as the sidecar's API proxy does. Every other write (DELETE, say) is
// sent unchanged, but only while this pod leads: no write at all is sent while Source says it
// does not lead. Reads (GET, HEAD, OPTIONS) pass through untouched, watches included.
//
// What it cannot stamp it refuses, unsent, with an [*UnstampableError]: protobuf or YAML
// bodies, JSON patches (application/json-patch+json: they can only add to what the object
// holds, and a token under /metadata/annotations may or may not be there), server-side apply
// (application/apply-patch+yaml), compressed bodies, bodies that are not a JSON object and
// bodies larger than [MaxStampBodyBytes].
//
// The token is asked of Source for every write, so a write never presents a token older than
// the sidecar's latest view; a write that still races a loss of leadership is refused by the
// fencing webhook. Use it under client-go by wrapping the transport it builds:
//
//	cfg.ContentType = "application/json" // client-go's default; protobuf cannot be stamped
//	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
//		return &fencedlease.Transport{Source: sidecar, Base: rt}
//	})
type Transport struct {
	// Source hands out the token for each write (a [*Client] or [TokenFiles]).
	Source TokenSource
	// Base sends the requests (http.DefaultTransport when nil); it adds the credentials.
	Base http.RoundTripper
}

// UnstampableError is a write the Transport refused to send because it cannot add the fencing
// annotations to its body.
type UnstampableError struct {
	Method, URL, ContentType string
	// Why says what is wrong and what to do instead.
	Why string
}

func (e *UnstampableError) Error() string {
	ct := e.ContentType
	if ct == "" {
		ct = "no content type"
	}
	return fmt.Sprintf("fencedlease: refusing to send %s %s (%s) unfenced, not sent: %s", e.Method, e.URL, ct, e.Why)
}

// bodyKind is what the Transport does with a request.
type bodyKind int

const (
	passRead      bodyKind = iota // a read: untouched, no token needed
	passWrite                     // a write without a body to stamp (DELETE): sent only while leading
	stampJSON                     // a JSON object body: stamped
	refuseUnknown                 // a body the Transport cannot stamp
)

// kindOf decides by method and content type, as the sidecar's proxy does (src/proxy.rs).
func kindOf(method, contentType string) (bodyKind, string) {
	ct := contentType
	if ct != "" {
		parsed, _, err := mime.ParseMediaType(contentType)
		if err != nil {
			return refuseUnknown, fmt.Sprintf("the Content-Type %q cannot be parsed", contentType)
		}
		ct = parsed
	}
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return passRead, ""
	case http.MethodPost, http.MethodPut:
		if ct == "application/json" || ct == "" {
			return stampJSON, ""
		}
		return refuseUnknown, "send creates and updates as application/json (with client-go: ContentType \"application/json\", not protobuf)"
	case http.MethodPatch:
		if ct == "application/merge-patch+json" || ct == "application/strategic-merge-patch+json" {
			return stampJSON, ""
		}
		return refuseUnknown, "use a merge patch (application/merge-patch+json) or a strategic merge patch (application/strategic-merge-patch+json); JSON patches and server-side apply cannot be stamped"
	default:
		return passWrite, ""
	}
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	kind, why := kindOf(req.Method, req.Header.Get("Content-Type"))
	if kind == passRead {
		return base.RoundTrip(req)
	}
	closeBody := func() {
		if req.Body != nil {
			req.Body.Close()
		}
	}
	refuse := func(why string) error {
		closeBody()
		return &UnstampableError{Method: req.Method, URL: req.URL.Redacted(), ContentType: req.Header.Get("Content-Type"), Why: why}
	}
	if kind == refuseUnknown {
		return nil, refuse(why)
	}
	if t.Source == nil {
		closeBody()
		return nil, errors.New("fencedlease: Transport.Source is nil: set it to the sidecar's Client (fencedlease.NewClient) or to TokenFiles")
	}
	tok, err := t.Source.Token(req.Context())
	if err != nil {
		closeBody()
		return nil, fmt.Errorf("fencedlease: refusing %s %s, not sent: %w", req.Method, req.URL.Redacted(), err)
	}
	if kind == passWrite {
		return base.RoundTrip(req)
	}
	if enc := req.Header.Get("Content-Encoding"); enc != "" && enc != "identity" {
		return nil, refuse("the body is compressed (Content-Encoding " + strconv.Quote(enc) + "): send it uncompressed")
	}
	var body []byte
	if req.Body != nil {
		body, err = readBounded(req.Body, MaxStampBodyBytes)
		closeBody()
		if err != nil {
			return nil, refuse("reading the body to stamp it: " + err.Error())
		}
	}
	stamped, err := stamp(body, tok, newWriteID(tok))
	if err != nil {
		return nil, refuse(err.Error() + "; the fencing annotations go in the JSON object's metadata.annotations")
	}
	out := req.Clone(req.Context())
	out.Body = io.NopCloser(bytes.NewReader(stamped))
	out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(stamped)), nil }
	out.ContentLength = int64(len(stamped))
	out.Header.Del("Content-Length")
	return base.RoundTrip(out)
}

// isNull says whether a raw JSON value is null.
func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

// stamp adds the fencing annotations to a JSON object (a full object or a merge patch),
// overriding any the caller set, and leaves every other byte of meaning as it was (numbers
// keep their precision).
func stamp(body []byte, tok Token, writeID string) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil || obj == nil {
		return nil, errors.New("the body is not a JSON object")
	}
	meta := map[string]json.RawMessage{}
	if raw, ok := obj["metadata"]; ok {
		if isNull(raw) || json.Unmarshal(raw, &meta) != nil {
			return nil, errors.New("metadata is not an object")
		}
	}
	ann := map[string]json.RawMessage{}
	if raw, ok := meta["annotations"]; ok && !isNull(raw) {
		if json.Unmarshal(raw, &ann) != nil {
			return nil, errors.New("metadata.annotations is not an object")
		}
	}
	for k, v := range map[string]string{
		TokenAnnotation:    tok.String(),
		LeaseUIDAnnotation: tok.LeaseUID,
		WriteIDAnnotation:  writeID,
	} {
		b, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		ann[k] = b
	}
	var err error
	if meta["annotations"], err = json.Marshal(ann); err != nil {
		return nil, err
	}
	if obj["metadata"], err = json.Marshal(meta); err != nil {
		return nil, err
	}
	return json.Marshal(obj)
}

var (
	writeCounter atomic.Uint64
	// processNonce tells this process's write ids from those of every other process (and of
	// this program's earlier runs).
	processNonce = sync.OnceValue(func() string {
		b := make([]byte, 8)
		_, _ = rand.Read(b) // crypto/rand.Read does not fail (Go 1.24+: it panics instead)
		return hex.EncodeToString(b)
	})
)

// newWriteID is a value never used before: the token, a random number of this process, and a
// counter.
func newWriteID(tok Token) string {
	return fmt.Sprintf("%d-%s-%d", tok.Value, processNonce(), writeCounter.Add(1))
}
