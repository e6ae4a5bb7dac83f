package fencedlease

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// apiServer records what reaches it and answers 200.
type apiServer struct {
	mu   sync.Mutex
	reqs []recorded
	srv  *httptest.Server
}

type recorded struct {
	method, path, contentType string
	body                      []byte
}

func newAPIServer(t *testing.T) *apiServer {
	a := &apiServer{}
	a.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		a.mu.Lock()
		a.reqs = append(a.reqs, recorded{r.Method, r.URL.Path, r.Header.Get("Content-Type"), b})
		a.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{}`))
	}))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *apiServer) received() []recorded {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]recorded(nil), a.reqs...)
}

// countingSource hands out tok (or err), counting the calls.
type countingSource struct {
	mu    sync.Mutex
	tok   Token
	err   error
	calls int
}

func (s *countingSource) Token(context.Context) (Token, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	return s.tok, s.err
}

func send(t *testing.T, c *http.Client, url, method, ct, body string) (*http.Response, error) {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	if ct != "" {
		req.Header.Set("Content-Type", ct)
	}
	resp, err := c.Do(req)
	if err == nil {
		resp.Body.Close()
	}
	return resp, err
}

func annotations(t *testing.T, body []byte) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("the stamped body is not JSON: %v: %s", err, body)
	}
	meta, _ := v["metadata"].(map[string]any)
	ann, _ := meta["annotations"].(map[string]any)
	if ann == nil {
		t.Fatalf("no annotations in %s", body)
	}
	return ann
}

func TestTransportStampsEveryBodyKindTheProxyStamps(t *testing.T) {
	api := newAPIServer(t)
	src := &countingSource{tok: Token{Value: 9, LeaseUID: "uid-9"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	cm := api.srv.URL + "/api/v1/namespaces/ns/configmaps"
	for _, tc := range []struct{ method, ct, body string }{
		{"POST", "application/json", `{"metadata":{"name":"a","labels":{"fencedlease.io/lease":"db"}},"data":{"n":"1"}}`},
		{"POST", "", `{"kind":"ConfigMap"}`},
		{"PUT", "application/json; charset=utf-8", `{"metadata":{"name":"a","annotations":null}}`},
		{"PATCH", "application/merge-patch+json", `{"data":{"n":"2"}}`},
		{"PATCH", "application/strategic-merge-patch+json", `{"metadata":{"annotations":{"keep":"me","fencedlease.io/token":"1","fencedlease.io/write-id":"old"}}}`},
	} {
		if _, err := send(t, c, cm+"/a", tc.method, tc.ct, tc.body); err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.ct, err)
		}
	}
	got := api.received()
	if len(got) != 5 || src.calls != 5 {
		t.Fatalf("%d requests reached the server, %d tokens asked for", len(got), src.calls)
	}
	ids := map[string]bool{}
	for i, r := range got {
		ann := annotations(t, r.body)
		if ann[TokenAnnotation] != "9" || ann[LeaseUIDAnnotation] != "uid-9" {
			t.Errorf("request %d: %v", i, ann)
		}
		id, _ := ann[WriteIDAnnotation].(string)
		if !strings.HasPrefix(id, "9-") || id == "old" {
			t.Errorf("request %d: write id %q", i, id)
		}
		ids[id] = true
	}
	if len(ids) != 5 {
		t.Fatalf("write ids repeat: %v", ids)
	}
	// Everything else is as the app sent it.
	var first map[string]any
	_ = json.Unmarshal(got[0].body, &first)
	if first["data"].(map[string]any)["n"] != "1" || first["metadata"].(map[string]any)["labels"].(map[string]any)[LeaseLabel] != "db" {
		t.Fatalf("the body lost fields: %s", got[0].body)
	}
	if ann := annotations(t, got[4].body); ann["keep"] != "me" {
		t.Fatalf("the app's own annotations must stay: %v", ann)
	}
	if got[2].contentType != "application/json; charset=utf-8" || got[3].contentType != "application/merge-patch+json" {
		t.Fatalf("content types must pass unchanged: %q %q", got[2].contentType, got[3].contentType)
	}
}

func TestTransportStampsServerSideApplyAndJSONPatches(t *testing.T) {
	api := newAPIServer(t)
	src := &countingSource{tok: Token{Value: 9, LeaseUID: "uid-9"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	url := api.srv.URL + "/api/v1/namespaces/ns/configmaps/a"
	apply := `{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a","labels":{"fencedlease.io/lease":"db"}}}`
	if _, err := send(t, c, url+"?fieldManager=m", "PATCH", "application/apply-patch+yaml", apply); err != nil {
		t.Fatal(err)
	}
	patch := `[{"op":"replace","path":"/data/a~1b","value":"1"}]`
	if _, err := send(t, c, url, "PATCH", "application/json-patch+json", patch); err != nil {
		t.Fatal(err)
	}
	got := api.received()
	if len(got) != 2 {
		t.Fatalf("%d requests reached the server", len(got))
	}
	if ann := annotations(t, got[0].body); ann[TokenAnnotation] != "9" || ann[LeaseUIDAnnotation] != "uid-9" || ann[WriteIDAnnotation] == nil {
		t.Fatalf("the applied configuration's annotations: %v", ann)
	}
	var ops []map[string]any
	if err := json.Unmarshal(got[1].body, &ops); err != nil || len(ops) != 4 {
		t.Fatalf("the JSON patch: %s (%v)", got[1].body, err)
	}
	if ops[0]["path"] != "/data/a~1b" || ops[0]["op"] != "replace" {
		t.Fatalf("the app's operation changed: %v", ops[0])
	}
	want := map[string]string{
		"/metadata/annotations/fencedlease.io~1token":     "9",
		"/metadata/annotations/fencedlease.io~1lease-uid": "uid-9",
	}
	for _, op := range ops[1:] {
		if op["op"] != "add" {
			t.Fatalf("not an add: %v", op)
		}
		if v, ok := want[op["path"].(string)]; ok && op["value"] != v {
			t.Fatalf("%v", op)
		}
	}
	if ops[3]["path"] != "/metadata/annotations/fencedlease.io~1write-id" {
		t.Fatalf("no write id: %v", ops[3])
	}
}

func TestStampKeepsNumbersExact(t *testing.T) {
	out, err := stamp([]byte(`{"spec":{"big":9007199254740993,"f":1.50},"metadata":{"name":"x"}}`), Token{Value: 3, LeaseUID: "u"}, "w")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(out, []byte(`"big":9007199254740993`)) || !bytes.Contains(out, []byte(`"f":1.50`)) {
		t.Fatalf("numbers changed: %s", out)
	}
}

func TestTransportRefusesWhatItCannotStampUnsent(t *testing.T) {
	api := newAPIServer(t)
	src := &countingSource{tok: Token{Value: 9, LeaseUID: "uid-9"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	url := api.srv.URL + "/api/v1/namespaces/ns/configmaps/a"
	for _, tc := range []struct{ name, method, ct, body, why string }{
		{"json patch not an array", "PATCH", "application/json-patch+json", `{"op":"add"}`, "not a JSON patch"},
		{"server-side apply in YAML", "PATCH", "application/apply-patch+yaml", "metadata: {name: a}", "not a JSON object"},
		{"protobuf", "POST", "application/vnd.kubernetes.protobuf", "k8s\x00", "not protobuf"},
		{"yaml", "PUT", "application/yaml", "metadata: {name: a}", "application/json"},
		{"not json", "POST", "application/json", `{"metadata":`, "not a JSON object"},
		{"an array", "POST", "application/json", `[]`, "not a JSON object"},
		{"a number", "PUT", "application/json", `3`, "not a JSON object"},
		{"null", "PUT", "application/json", `null`, "not a JSON object"},
		{"empty", "POST", "application/json", ``, "not a JSON object"},
		{"metadata a number", "POST", "application/json", `{"metadata":3}`, "metadata is not an object"},
		{"metadata null", "PATCH", "application/merge-patch+json", `{"metadata":null}`, "metadata is not an object"},
		{"annotations a list", "POST", "application/json", `{"metadata":{"annotations":[]}}`, "annotations is not an object"},
		{"bad content type", "POST", "application/json; =", `{}`, "cannot be parsed"},
		{"too large", "POST", "application/json", `{"data":{"x":"` + strings.Repeat("x", MaxStampBodyBytes) + `"}}`, "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := send(t, c, url, tc.method, tc.ct, tc.body)
			var ue *UnstampableError
			if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.why) || !strings.Contains(err.Error(), "not sent") {
				t.Fatalf("want an UnstampableError saying %q, got %v", tc.why, err)
			}
		})
	}
	t.Run("gzip", func(t *testing.T) {
		req, _ := http.NewRequest("POST", url, strings.NewReader("\x1f\x8b"))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Content-Encoding", "gzip")
		_, err := c.Do(req)
		var ue *UnstampableError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), "compressed") {
			t.Fatalf("%v", err)
		}
	})
	if n := len(api.received()); n != 0 {
		t.Fatalf("%d refused writes reached the server", n)
	}
}

func TestTransportRefusesWritesWhileNotLeadingAndPassesReads(t *testing.T) {
	api := newAPIServer(t)
	src := &countingSource{err: &NotLeadingError{Holder: "pod-b", Source: "test"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	url := api.srv.URL + "/api/v1/namespaces/ns/configmaps/a"
	for m, ct := range map[string]string{"POST": "application/json", "PUT": "application/json", "PATCH": "application/merge-patch+json", "DELETE": ""} {
		_, err := send(t, c, url, m, ct, `{}`)
		if !errors.Is(err, ErrNotLeading) || !strings.Contains(err.Error(), "not sent") || !strings.Contains(err.Error(), "pod-b") {
			t.Fatalf("%s while not leading: %v", m, err)
		}
	}
	if n := len(api.received()); n != 0 {
		t.Fatalf("%d writes reached the server while not leading", n)
	}
	calls := src.calls
	for _, m := range []string{"GET", "HEAD", "OPTIONS"} {
		if _, err := send(t, c, url+"?watch=true", m, "", ""); err != nil {
			t.Fatalf("%s must pass while not leading: %v", m, err)
		}
	}
	if src.calls != calls {
		t.Fatal("reads must not ask for the token")
	}
	if n := len(api.received()); n != 3 {
		t.Fatalf("%d reads reached the server", n)
	}
	// A DELETE while leading passes with its body as it was (deletes carry no annotations;
	// the webhook does not fence them).
	src.mu.Lock()
	src.err, src.tok = nil, Token{Value: 4, LeaseUID: "u"}
	src.mu.Unlock()
	del := `{"kind":"DeleteOptions","propagationPolicy":"Background"}`
	if _, err := send(t, c, url, "DELETE", "application/json", del); err != nil {
		t.Fatal(err)
	}
	got := api.received()
	if last := got[len(got)-1]; last.method != "DELETE" || string(last.body) != del {
		t.Fatalf("the DELETE changed: %+v", last)
	}
}

// A base transport that retries with GetBody, as net/http does on a dropped connection, sees
// the stamped body again.
func TestTransportStampedBodyCanBeResent(t *testing.T) {
	var bodies []string
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		b, _ := io.ReadAll(r.Body)
		bodies = append(bodies, string(b))
		again, err := r.GetBody()
		if err != nil {
			return nil, err
		}
		b, _ = io.ReadAll(again)
		bodies = append(bodies, string(b))
		if r.ContentLength != int64(len(b)) {
			t.Errorf("ContentLength %d for a body of %d", r.ContentLength, len(b))
		}
		return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader("")), Request: r}, nil
	})
	tr := &Transport{Source: &countingSource{tok: Token{Value: 2, LeaseUID: "u"}}, Base: base}
	req, _ := http.NewRequest("POST", "http://api/x", strings.NewReader(`{}`))
	orig := req.Body
	if _, err := tr.RoundTrip(req); err != nil {
		t.Fatal(err)
	}
	if len(bodies) != 2 || bodies[0] != bodies[1] || !strings.Contains(bodies[0], WriteIDAnnotation) {
		t.Fatalf("%q", bodies)
	}
	if req.Body != orig {
		t.Fatal("RoundTrip must not modify the caller's request")
	}
}

func TestTransportWithTheSidecarAsSource(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(11, "uid-11", 5*time.Second))
	api := newAPIServer(t)
	c := &http.Client{Transport: &Transport{Source: f.client}}
	if _, err := send(t, c, api.srv.URL+"/api/v1/namespaces/ns/configmaps", "POST", "application/json", `{}`); err != nil {
		t.Fatal(err)
	}
	if ann := annotations(t, api.received()[0].body); ann[TokenAnnotation] != "11" {
		t.Fatalf("%v", ann)
	}
	f.set(followingStatus("pod-b"))
	if _, err := send(t, c, api.srv.URL+"/api/v1/namespaces/ns/configmaps", "POST", "application/json", `{}`); !errors.Is(err, ErrNotLeading) {
		t.Fatalf("the token is asked for every write: %v", err)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A DELETE of a protected object goes out announced: read, announcing merge patch (the intent
// is the patch's own write id, the token the current one), then the delete; an unprotected
// object is only read first; a refused announcement is the answer, and no delete is sent.
func TestTransportAnnouncesTheDeleteOfAProtectedObject(t *testing.T) {
	var mu sync.Mutex
	var seen []recorded
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, recorded{r.Method, r.URL.Path, r.Header.Get("Content-Type"), b})
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/plain"):
			_, _ = w.Write([]byte(`{"metadata":{"labels":{"app":"x"}}}`))
		case r.Method == http.MethodGet:
			_, _ = w.Write([]byte(`{"metadata":{"labels":{"fencedlease.io/lease":"db"}}}`))
		case r.Method == http.MethodPatch && strings.HasSuffix(r.URL.Path, "/guarded"):
			_, _ = w.Write([]byte(`{"metadata":{"resourceVersion":"42"}}`))
		case r.Method == http.MethodPatch && strings.HasSuffix(r.URL.Path, "/refused"):
			w.WriteHeader(http.StatusForbidden)
			_, _ = w.Write([]byte(`{"kind":"Status","code":403,"message":"fencedlease: stale token 6"}`))
		default:
			_, _ = w.Write([]byte(`{}`))
		}
	}))
	defer srv.Close()
	src := &countingSource{tok: Token{Value: 7, LeaseUID: "u1"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	delWith := func(name, options string) (int, []recorded) {
		mu.Lock()
		seen = nil
		mu.Unlock()
		req, _ := http.NewRequest(http.MethodDelete, srv.URL+"/api/v1/namespaces/n/configmaps/"+name, strings.NewReader(options))
		req.Header.Set("Content-Type", "application/json")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("delete %s: %v", name, err)
		}
		resp.Body.Close()
		mu.Lock()
		defer mu.Unlock()
		return resp.StatusCode, append([]recorded(nil), seen...)
	}
	del := func(name string) (int, []recorded) { return delWith(name, `{"propagationPolicy":"Background"}`) }
	methods := func(rs []recorded) string {
		var m []string
		for _, r := range rs {
			m = append(m, r.method)
		}
		return strings.Join(m, " ")
	}
	code, rs := del("protected")
	if got := methods(rs); code != 200 || got != "GET PATCH DELETE" {
		t.Fatalf("protected: %d %q", code, got)
	}
	var patch struct {
		Metadata struct {
			Annotations map[string]string `json:"annotations"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(rs[1].body, &patch); err != nil || rs[1].contentType != "application/merge-patch+json" {
		t.Fatalf("the announcement %s (%s): %v", rs[1].body, rs[1].contentType, err)
	}
	a := patch.Metadata.Annotations
	if a[TokenAnnotation] != "7" || a[LeaseUIDAnnotation] != "u1" || a[WriteIDAnnotation] == "" || a[DeleteIntentAnnotation] != a[WriteIDAnnotation] {
		t.Fatalf("the announcement's annotations: %v", a)
	}
	if string(rs[2].body) != `{"propagationPolicy":"Background"}` {
		t.Fatalf("the delete's own body must go out unchanged: %s", rs[2].body)
	}
	if code, rs := del("plain"); code != 200 || methods(rs) != "GET DELETE" {
		t.Fatalf("plain: %d %q", code, methods(rs))
	}
	if code, rs := del("refused"); code != 403 || methods(rs) != "GET PATCH" {
		t.Fatalf("refused announcement: %d %q", code, methods(rs))
	}
	// The caller's precondition guards the announcement, then moves to the version it wrote.
	code, rs = delWith("guarded", `{"preconditions":{"resourceVersion":"7"}}`)
	if code != 200 || methods(rs) != "GET PATCH DELETE" {
		t.Fatalf("guarded: %d %q", code, methods(rs))
	}
	if !strings.Contains(string(rs[1].body), `"resourceVersion":"7"`) {
		t.Fatalf("the announcement is not guarded by the caller's precondition: %s", rs[1].body)
	}
	if string(rs[2].body) != `{"preconditions":{"resourceVersion":"42"}}` {
		t.Fatalf("the delete's precondition must move to the announcement's version: %s", rs[2].body)
	}
}

// A write pinned to a tenure (WithTenure) goes out only while its token is the current one;
// once the token moved on, it is refused unsent with ErrTenureOver.
func TestTransportSendsAPinnedWriteOnlyInItsTenure(t *testing.T) {
	api := newAPIServer(t)
	src := &countingSource{tok: Token{Value: 7, LeaseUID: "u1"}}
	c := &http.Client{Transport: &Transport{Source: src}}
	send := func(ctx context.Context) error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPatch, api.srv.URL+"/api/v1/namespaces/n/configmaps/c", strings.NewReader(`{"data":{"a":"1"}}`))
		req.Header.Set("Content-Type", "application/merge-patch+json")
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	pinned := WithTenure(context.Background(), Token{Value: 7, LeaseUID: "u1"})
	if err := send(pinned); err != nil {
		t.Fatalf("a write pinned to the current tenure: %v", err)
	}
	if tok, ok := TenureOf(pinned); !ok || tok.Value != 7 {
		t.Fatalf("TenureOf: %v %v", tok, ok)
	}
	src.mu.Lock()
	src.tok = Token{Value: 10, LeaseUID: "u1"} // lost and acquired again
	src.mu.Unlock()
	err := send(pinned)
	if !errors.Is(err, ErrTenureOver) || !strings.Contains(err.Error(), "decided under token 7") {
		t.Fatalf("a write pinned to an ended tenure: %v", err)
	}
	if n := len(api.received()); n != 1 {
		t.Fatalf("the refused write reached the API server: %d requests", n)
	}
	if err := send(context.Background()); err != nil {
		t.Fatalf("an unpinned write: %v", err)
	}
}

// Acknowledge tells the sidecar the app knows its tenure; a stale token is ErrNotCurrent.
func TestAcknowledgeOnlyTheCurrentTenure(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(7, "u1", time.Minute))
	ctx := context.Background()
	if err := f.client.Acknowledge(ctx, Token{Value: 7, LeaseUID: "u1"}); err != nil {
		t.Fatalf("acknowledging the current tenure: %v", err)
	}
	if err := f.client.Acknowledge(ctx, Token{Value: 6, LeaseUID: "u1"}); !errors.Is(err, ErrNotCurrent) {
		t.Fatalf("acknowledging an old tenure: %v", err)
	}
}
