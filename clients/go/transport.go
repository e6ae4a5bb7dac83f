package fencedlease

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// The annotations every write to a protected object carries (the book, docs/src/using-it.md,
// "Protect what the leader writes"; elector/src/api.rs defines them).
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
	// DeleteIntentAnnotation announces a delete: a fenced update sets it to its own write id,
	// then the delete follows. A protected object is deleted only as its last write announced.
	DeleteIntentAnnotation = "fencedlease.io/delete-intent"
)

// MaxStampBodyBytes is the largest request body the Transport reads to stamp it (the same
// bound as the sidecar's own API proxy).
const MaxStampBodyBytes = 8 << 20

// Transport is an http.RoundTripper for a Kubernetes API client. It adds the current token,
// the lease UID and a new write id (the annotations [TokenAnnotation], [LeaseUIDAnnotation],
// [WriteIDAnnotation]) to the JSON body of every create (POST), update (PUT), merge patch,
// strategic merge patch and server-side apply (application/apply-patch+yaml sent as JSON, as
// client-go and controller-runtime send it), and appends three "add" operations to a JSON
// patch (application/json-patch+json; they need metadata.annotations to exist, as it does on
// every protected object, whose create presented a token). A DELETE of a protected object is
// announced first, as the fencing webhook asks (a merge patch stamped with the token that sets
// [DeleteIntentAnnotation] to its own write id), then sent; the Transport reads the object
// (GET, limit=1) to know whether it is protected. Every write is sent only while this pod
// leads: no write at all is sent while Source says it does not lead. Reads (GET, HEAD, OPTIONS) pass through untouched, watches included.
//
// What it cannot stamp it refuses, unsent, with an [*UnstampableError]: protobuf or YAML
// bodies (server-side apply in YAML included: send it as JSON), compressed bodies, bodies that
// are not a JSON object (a JSON array for a JSON patch) and bodies larger than
// [MaxStampBodyBytes].
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

// ErrTenureOver is what the Transport returns, unsent, for a write whose context is pinned
// ([WithTenure]) to a token that is no longer the current one.
var ErrTenureOver = errors.New("fencedlease: the tenure the write was decided in is over")

type tenureKey struct{}

// WithTenure pins the writes sent with ctx to tok, the token they were decided under: the
// Transport sends them only while tok is still the current token, and refuses them unsent with
// an error wrapping [ErrTenureOver] once it is not. Without a pin a write decided under token N,
// delayed while the pod lost the lease and got it back under N+k, would go out stamped N+k over
// the work of whoever led in between. [Runnable] pins the context it gives Run.
func WithTenure(ctx context.Context, tok Token) context.Context {
	return context.WithValue(ctx, tenureKey{}, tok)
}

// TenureOf is the token ctx is pinned to by [WithTenure], if any.
func TenureOf(ctx context.Context) (Token, bool) {
	tok, ok := ctx.Value(tenureKey{}).(Token)
	return tok, ok
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
	passRead       bodyKind = iota // a read: untouched, no token needed
	passWrite                      // a write without a body to stamp (DELETE): sent only while leading
	stampJSON                      // a JSON object body: stamped
	stampJSONPatch                 // a JSON patch: the stamp appended as "add" operations
	refuseUnknown                  // a body the Transport cannot stamp
)

// kindOf decides by method and content type, as the sidecar's proxy does (src/sidecar/proxy.rs).
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
		switch ct {
		case "application/merge-patch+json", "application/strategic-merge-patch+json",
			"application/apply-patch+yaml", "application/apply-patch+json":
			return stampJSON, ""
		case "application/json-patch+json":
			return stampJSONPatch, ""
		}
		return refuseUnknown, "use a JSON merge, strategic merge or JSON patch, or server-side apply in JSON"
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
	if pinned, ok := TenureOf(req.Context()); ok && pinned != tok {
		closeBody()
		return nil, fmt.Errorf("%w: refusing %s %s, not sent: it was decided under token %s (lease %s), and the pod now leads with token %s (lease %s); decide again under the current token", ErrTenureOver, req.Method, req.URL.Redacted(), pinned, pinned.LeaseUID, tok, tok.LeaseUID)
	}
	if kind == passWrite {
		if req.Method == http.MethodDelete {
			return deleteAnnounced(base, req, tok)
		}
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
	stamper := stamp
	if kind == stampJSONPatch {
		stamper = stampPatch
	}
	stamped, err := stamper(body, tok, newWriteID(tok))
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

// deleteAnnounced sends the delete req asks for, announced first if its object is protected.
// The caller's preconditions.resourceVersion guards the announcement (a merge patch naming a
// resourceVersion is refused once the object moved on) and then moves to the announcement's
// version, so the delete still happens only to the version the caller saw.
func deleteAnnounced(base http.RoundTripper, req *http.Request, tok Token) (*http.Response, error) {
	var body []byte
	if req.Body != nil {
		var err error
		body, err = readBounded(req.Body, MaxStampBodyBytes)
		req.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("fencedlease: reading the delete's options, not sent: %w", err)
		}
	}
	var options map[string]any
	_ = json.Unmarshal(body, &options)
	pre, _ := options["preconditions"].(map[string]any)
	rv, _ := pre["resourceVersion"].(string)
	resp, written, err := announceDelete(base, req, tok, rv)
	if resp != nil || err != nil {
		return resp, err
	}
	if written != "" && rv != "" {
		pre["resourceVersion"] = written
		if body, err = json.Marshal(options); err != nil {
			return nil, err
		}
	}
	out := req.Clone(req.Context())
	out.Body = io.NopCloser(bytes.NewReader(body))
	out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	out.ContentLength = int64(len(body))
	out.Header.Del("Content-Length")
	if len(body) == 0 {
		out.Body, out.GetBody = nil, nil
	}
	return base.RoundTrip(out)
}

// announceDelete announces the delete req asks for, if its object is protected: it reads the
// object and sends the announcing merge patch (with the caller's query, dryRun included, and
// resourceVersion rv as its precondition when set), both through base with req's headers (its
// credentials). It returns a response only to answer req with it (the announcement's refusal);
// else the resourceVersion the announcement wrote ("" when there was nothing to announce: an
// unprotected or unreadable object, or a collection, whose delete the API server and the
// webhook answer themselves).
func announceDelete(base http.RoundTripper, req *http.Request, tok Token, rv string) (*http.Response, string, error) {
	get := req.Clone(req.Context())
	get.Method, get.Body, get.GetBody, get.ContentLength = http.MethodGet, nil, nil, 0
	get.Header.Del("Content-Type")
	get.Header.Set("Accept", "application/json") // a protobuf client's Accept would hide the labels
	get.URL.RawQuery = "limit=1"
	resp, err := base.RoundTrip(get)
	if err != nil {
		return nil, "", nil
	}
	body, _ := readBounded(resp.Body, MaxStampBodyBytes)
	resp.Body.Close()
	var stored struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &stored) != nil || stored.Metadata.Labels[LeaseLabel] == "" {
		return nil, "", nil
	}
	id := newWriteID(tok)
	meta := map[string]any{"annotations": map[string]string{
		TokenAnnotation: tok.String(), LeaseUIDAnnotation: tok.LeaseUID,
		WriteIDAnnotation: id, DeleteIntentAnnotation: id,
	}}
	if rv != "" {
		meta["resourceVersion"] = rv
	}
	patch, _ := json.Marshal(map[string]any{"metadata": meta})
	p := req.Clone(req.Context())
	p.Method, p.URL.RawQuery = http.MethodPatch, ""
	if dry := req.URL.Query()["dryRun"]; len(dry) > 0 { // a dry-run delete announces in a dry run
		p.URL.RawQuery = url.Values{"dryRun": dry}.Encode()
	}
	p.Body = io.NopCloser(bytes.NewReader(patch))
	p.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(patch)), nil }
	p.ContentLength = int64(len(patch))
	p.Header.Set("Content-Type", "application/merge-patch+json")
	p.Header.Del("Content-Length")
	resp, err = base.RoundTrip(p)
	if err != nil {
		return nil, "", fmt.Errorf("fencedlease: announcing the delete of %s, the delete was not sent: %w", req.URL.Redacted(), err)
	}
	if resp.StatusCode/100 != 2 {
		return resp, "", nil
	}
	answer, _ := readBounded(resp.Body, MaxStampBodyBytes)
	resp.Body.Close()
	var written struct {
		Metadata struct {
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
	}
	_ = json.Unmarshal(answer, &written)
	return nil, written.Metadata.ResourceVersion, nil
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

// stampPatch appends to a JSON patch one "add" operation per fencing annotation (an add of an
// existing member replaces it). The operations before them are kept byte for byte.
func stampPatch(body []byte, tok Token, writeID string) ([]byte, error) {
	var ops []json.RawMessage
	if err := json.Unmarshal(body, &ops); err != nil || ops == nil {
		return nil, errors.New("the body is not a JSON patch (a JSON array of operations)")
	}
	escape := strings.NewReplacer("~", "~0", "/", "~1")
	for _, kv := range [][2]string{
		{TokenAnnotation, tok.String()},
		{LeaseUIDAnnotation, tok.LeaseUID},
		{WriteIDAnnotation, writeID},
	} {
		op, err := json.Marshal(map[string]string{
			"op": "add", "path": "/metadata/annotations/" + escape.Replace(kv[0]), "value": kv[1],
		})
		if err != nil {
			return nil, err
		}
		ops = append(ops, op)
	}
	return json.Marshal(ops)
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
