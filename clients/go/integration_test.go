package fencedlease

// The integration test against real sidecars, a real API server and the real fencing webhook.
// tests/client_go.rs (cargo test --test client_go) starts them and runs this with the
// variables below; it always sets FENCEDLEASE_IT_REQUIRED=1, so that this test fails, rather
// than skips, when anything is missing. Run by hand without the variables it skips.
//
//	FENCEDLEASE_IT_URLS          the sidecars' API URLs, comma-separated (two)
//	FENCEDLEASE_IT_TOKEN_DIRS    their token folders, in the same order
//	FENCEDLEASE_IT_NAMESPACE     the namespace of the lease and of the protected ConfigMap
//	FENCEDLEASE_IT_LEASE         the FencedLease the sidecars campaign for
//	FENCEDLEASE_IT_KUBE_SERVER   https://HOST:PORT of the API server
//	FENCEDLEASE_IT_KUBE_CA       its CA certificate (PEM file)
//	FENCEDLEASE_IT_KUBE_TOKEN    a bearer token file of a user that may write ConfigMaps there
//	FENCEDLEASE_IT_CONTROL       a folder: the test writes "kill" (a sidecar URL) there, the Rust
//	                             side SIGKILLs that sidecar and writes "killed"

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

type itEnv struct {
	sidecars  []*Client
	tokenDirs []string
	ns, lease string
	server    string
	kube      http.RoundTripper // TLS to the API server, with the bearer token
	control   string
}

func integrationEnv(t *testing.T) itEnv {
	t.Helper()
	get := func(name string) string {
		v := os.Getenv(name)
		if v == "" {
			t.Fatalf("$%s is not set: tests/client_go.rs sets it (run `cargo test --test client_go`)", name)
		}
		return v
	}
	if os.Getenv("FENCEDLEASE_IT_URLS") == "" {
		if os.Getenv("FENCEDLEASE_IT_REQUIRED") == "1" {
			t.Fatal("FENCEDLEASE_IT_REQUIRED=1 but $FENCEDLEASE_IT_URLS is not set: the integration test would not run")
		}
		t.Skip("no sidecars ($FENCEDLEASE_IT_URLS unset): run `cargo test --test client_go` to run this against real ones")
	}
	e := itEnv{
		ns:      get("FENCEDLEASE_IT_NAMESPACE"),
		lease:   get("FENCEDLEASE_IT_LEASE"),
		server:  strings.TrimSuffix(get("FENCEDLEASE_IT_KUBE_SERVER"), "/"),
		control: get("FENCEDLEASE_IT_CONTROL"),
	}
	for _, u := range strings.Split(get("FENCEDLEASE_IT_URLS"), ",") {
		c, err := NewClient(u)
		if err != nil {
			t.Fatal(err)
		}
		e.sidecars = append(e.sidecars, c)
	}
	e.tokenDirs = strings.Split(get("FENCEDLEASE_IT_TOKEN_DIRS"), ",")
	if len(e.sidecars) != 2 || len(e.tokenDirs) != 2 {
		t.Fatalf("want two sidecars and two token folders, got %d and %d", len(e.sidecars), len(e.tokenDirs))
	}
	for i, c := range e.sidecars {
		c.SecretFile = filepath.Join(e.tokenDirs[i], "api-secret")
	}
	ca, err := os.ReadFile(get("FENCEDLEASE_IT_KUBE_CA"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		t.Fatal("FENCEDLEASE_IT_KUBE_CA holds no PEM certificate")
	}
	token, err := os.ReadFile(get("FENCEDLEASE_IT_KUBE_TOKEN"))
	if err != nil {
		t.Fatal(err)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	e.kube = bearer{token: strings.TrimSpace(string(token)), base: tr}
	return e
}

// bearer adds the credentials, as client-go's own transport does under the fencing one.
type bearer struct {
	token string
	base  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.base.RoundTrip(r)
}

// kubeAnswer is an answer of the API server: its code and body.
type kubeAnswer struct {
	code int
	body map[string]any
	raw  string
}

func (a kubeAnswer) message() string { s, _ := a.body["message"].(string); return s }

func (a kubeAnswer) annotations() map[string]any {
	meta, _ := a.body["metadata"].(map[string]any)
	ann, _ := meta["annotations"].(map[string]any)
	return ann
}

// kubeDo sends one request to the API server through rt.
func (e itEnv) kubeDo(rt http.RoundTripper, method, path, ct, body string) (kubeAnswer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.server+path, r)
	if err != nil {
		return kubeAnswer{}, err
	}
	if ct != "" {
		req.Header.Set("Content-Type", ct)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := (&http.Client{Transport: rt}).Do(req)
	if err != nil {
		return kubeAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := readBounded(resp.Body, 1<<20)
	if err != nil {
		return kubeAnswer{}, err
	}
	a := kubeAnswer{code: resp.StatusCode, raw: string(b)}
	_ = json.Unmarshal(b, &a.body)
	return a, nil
}

func (e itEnv) cmPath(name string) string {
	p := "/api/v1/namespaces/" + e.ns + "/configmaps"
	if name != "" {
		p += "/" + name
	}
	return p
}

// fenced is the Transport of a pod: its sidecar's token on every write, over the credentials.
func (e itEnv) fenced(src TokenSource) http.RoundTripper {
	return &Transport{Source: src, Base: e.kube}
}

// mustWrite sends a write and wants code.
func (e itEnv) mustWrite(t *testing.T, what string, rt http.RoundTripper, method, path, ct, body string, code int) kubeAnswer {
	t.Helper()
	a, err := e.kubeDo(rt, method, path, ct, body)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if a.code != code {
		t.Fatalf("%s: want %d, got %d: %s", what, code, a.code, a.raw)
	}
	return a
}

// leader waits until exactly one sidecar leads and the other names it as the holder.
func (e itEnv) leader(t *testing.T, ctx context.Context, within time.Duration) (int, Status) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		var sts [2]Status
		var errs [2]error
		for i, c := range e.sidecars {
			sts[i], errs[i] = c.Status(ctx)
		}
		for i := range 2 {
			j := 1 - i
			if errs[i] == nil && sts[i].Leading && (errs[j] != nil || (!sts[j].Leading && sts[j].HolderName() == sts[i].Identity)) {
				return i, sts[i]
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no single leader within %v: %+v %v / %+v %v", within, sts[0], errs[0], sts[1], errs[1])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// recorder follows a Watch in the background and keeps every status.
type recorder struct {
	mu   sync.Mutex
	seen []Status
	errs []error
}

func (r *recorder) follow(ctx context.Context, c *Client) {
	go func() {
		for st, err := range c.Watch(ctx) {
			r.mu.Lock()
			if err != nil {
				r.errs = append(r.errs, err)
			} else {
				r.seen = append(r.seen, st)
			}
			r.mu.Unlock()
		}
	}()
}

// leadingAbove waits for a status that leads with a token above min.
func (r *recorder) leadingAbove(t *testing.T, min int64, within time.Duration) Token {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		for _, st := range r.seen {
			if tok, ok := st.LeadingToken(); ok && tok.Value > min {
				r.mu.Unlock()
				return tok
			}
		}
		r.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	t.Fatalf("the watch saw no leading status above token %d within %v: statuses %+v, errors %v", min, within, r.seen, r.errs)
	return Token{}
}

// runs records a Runnable's terms.
type runs struct {
	mu      sync.Mutex
	started []Token
	causes  []error
}

func (r *runs) run(ctx context.Context, tok Token) error {
	r.mu.Lock()
	r.started = append(r.started, tok)
	r.mu.Unlock()
	<-ctx.Done()
	r.mu.Lock()
	r.causes = append(r.causes, context.Cause(ctx))
	r.mu.Unlock()
	return nil
}

func (r *runs) wait(t *testing.T, what string, within time.Duration, cond func(started []Token, causes []error) bool) {
	t.Helper()
	waitFor(t, within, what, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return cond(r.started, r.causes)
	})
}

func TestIntegrationAgainstRealSidecars(t *testing.T) {
	e := integrationEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// 1. Token agrees with /v1/status, with the lease on the API server and with the token
	// files; the follower is told it does not lead, and by whom.
	li, st := e.leader(t, ctx, 20*time.Second)
	leader, follower := e.sidecars[li], e.sidecars[1-li]
	tok, err := leader.Token(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := st.LeadingToken(); tok != want {
		t.Fatalf("Token %+v, /v1/status %+v", tok, want)
	}
	lease := e.mustWrite(t, "reading the lease", e.kube, "GET", "/apis/fencedlease.io/v1alpha1/namespaces/"+e.ns+"/fencedleases/"+e.lease, "", "", 200)
	meta := lease.body["metadata"].(map[string]any)
	if fmt.Sprint(meta["generation"]) != tok.String() || meta["uid"] != tok.LeaseUID {
		t.Fatalf("the lease has generation %v uid %v; the sidecar says %+v", meta["generation"], meta["uid"], tok)
	}
	// The real sidecar takes an acknowledgement of the current tenure only.
	if err := leader.Acknowledge(ctx, tok); err != nil {
		t.Fatalf("Acknowledge of the current tenure: %v", err)
	}
	if err := leader.Acknowledge(ctx, Token{Value: tok.Value - 1, LeaseUID: tok.LeaseUID}); !errors.Is(err, ErrNotCurrent) {
		t.Fatalf("Acknowledge of an earlier token: %v", err)
	}
	_, err = follower.Token(ctx)
	var nl *NotLeadingError
	if !errors.As(err, &nl) || nl.Holder != st.Identity {
		t.Fatalf("the follower's Token: %v", err)
	}
	// The sidecar writes the files just after its state changes: give it a moment.
	var ft Token
	waitFor(t, 2*time.Second, "the leader's token files to hold its token", func() bool {
		ft, err = (TokenFiles{Dir: e.tokenDirs[li]}).Token(ctx)
		return err == nil && ft == tok
	})
	if _, err := (TokenFiles{Dir: e.tokenDirs[1-li]}).Token(ctx); !errors.Is(err, ErrNotLeading) {
		t.Fatalf("the follower's token files: %v", err)
	}

	// 2. The webhook judges this namespace: an unstamped write is refused by it ...
	cm := func(name, v string) string {
		return fmt.Sprintf(`{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":%q,"labels":{%q:%q}},"data":{"v":%q}}`, name, LeaseLabel, e.lease, v)
	}
	a := e.mustWrite(t, "an unstamped create", e.kube, "POST", e.cmPath(""), "application/json", cm("inv", "0"), 403)
	if !strings.Contains(a.message(), "fencedlease") {
		t.Fatalf("refused, but not by the webhook: %s", a.raw)
	}
	// ... and the leader's stamped writes of each kind are accepted.
	leaderRT, followerRT := e.fenced(leader), e.fenced(follower)
	a = e.mustWrite(t, "a stamped create", leaderRT, "POST", e.cmPath(""), "application/json", cm("inv", "1"), 201)
	if ann := a.annotations(); ann[TokenAnnotation] != tok.String() || ann[LeaseUIDAnnotation] != tok.LeaseUID || ann[WriteIDAnnotation] == nil {
		t.Fatalf("stored annotations %v", ann)
	}
	e.mustWrite(t, "a stamped merge patch", leaderRT, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"2"}}`, 200)
	e.mustWrite(t, "a stamped strategic merge patch", leaderRT, "PATCH", e.cmPath("inv"), "application/strategic-merge-patch+json", `{"data":{"v":"3"}}`, 200)
	cur := e.mustWrite(t, "a read", leaderRT, "GET", e.cmPath("inv"), "", "", 200)
	cur.body["data"] = map[string]any{"v": "4"}
	put, _ := json.Marshal(cur.body) // carries the stored write id: the Transport replaces it
	e.mustWrite(t, "a stamped update", leaderRT, "PUT", e.cmPath("inv"), "application/json", string(put), 200)
	e.mustWrite(t, "a stamped JSON patch", leaderRT, "PATCH", e.cmPath("inv"), "application/json-patch+json", `[{"op":"replace","path":"/data/v","value":"4"}]`, 200)
	e.mustWrite(t, "a stamped server-side apply", leaderRT, "PATCH", e.cmPath("inv")+"?fieldManager=go-test&force=true", "application/apply-patch+yaml",
		`{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"inv","labels":{"`+LeaseLabel+`":"`+e.lease+`"}},"data":{"v":"4"}}`, 200)
	// What the Transport cannot stamp, and the follower's writes, are not sent at all.
	_, err = e.kubeDo(leaderRT, "PATCH", e.cmPath("inv"), "application/apply-patch+yaml", "metadata: {name: inv}")
	var ue *UnstampableError
	if !errors.As(err, &ue) {
		t.Fatalf("server-side apply in YAML: %v", err)
	}
	_, err = e.kubeDo(followerRT, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"follower"}}`)
	if !errors.Is(err, ErrNotLeading) {
		t.Fatalf("the follower's write: %v", err)
	}
	if v := e.mustWrite(t, "a read", followerRT, "GET", e.cmPath("inv"), "", "", 200).body["data"]; fmt.Sprint(v) != "map[v:4]" {
		t.Fatalf("data %v", v)
	}

	// 3. A handover by release: a Watch on the follower sees it take over; the Runnables
	// move Run from one pod to the other; the old token is refused by the webhook.
	var watch recorder
	watch.follow(ctx, follower)
	var runsOf [2]runs
	for i, c := range e.sidecars {
		go func() { _ = (&Runnable{Client: c, Run: runsOf[i].run}).Start(ctx) }()
	}
	runsOf[li].wait(t, "the leader's Runnable to run", 5*time.Second, func(s []Token, _ []error) bool { return len(s) == 1 && s[0] == tok })
	if err := leader.Release(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	tok2 := watch.leadingAbove(t, tok.Value, 10*time.Second)
	t.Logf("release: the follower's Watch saw it lead with token %s (was %s) %v after Release", tok2, tok, time.Since(released).Round(time.Millisecond))
	runsOf[li].wait(t, "the old leader's Run to be cancelled", 5*time.Second, func(_ []Token, c []error) bool {
		return len(c) == 1 && errors.Is(c[0], ErrLeadershipLost)
	})
	runsOf[1-li].wait(t, "the new leader's Run to start", 5*time.Second, func(s []Token, _ []error) bool { return len(s) == 1 && s[0] == tok2 })
	stale := e.fenced(TokenSourceFunc(func(context.Context) (Token, error) { return tok, nil }))
	a = e.mustWrite(t, "a write stamped with the old token", stale, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"stale"}}`, 403)
	if !strings.Contains(a.message(), "stale token "+tok.String()) {
		t.Fatalf("refused, but not as stale: %s", a.raw)
	}
	if _, err := e.kubeDo(leaderRT, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"old"}}`); !errors.Is(err, ErrNotLeading) {
		t.Fatalf("the old leader's Transport must not send: %v", err)
	}
	e.mustWrite(t, "the new leader's write", followerRT, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"5"}}`, 200)

	// 4. A handover by death: the Rust side SIGKILLs the new leader; once its lease runs out
	// the first sidecar takes over, and a Watch on it sees that.
	var watch2 recorder
	watch2.follow(ctx, leader)
	killAsked := time.Now()
	if err := os.WriteFile(filepath.Join(e.control, "kill"), []byte(follower.URL()), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the Rust side to kill the leader", func() bool {
		_, err := os.Stat(filepath.Join(e.control, "killed"))
		return err == nil
	})
	tok3 := watch2.leadingAbove(t, tok2.Value, 15*time.Second)
	t.Logf("kill: the survivor's Watch saw it lead with token %s %v after the kill was requested", tok3, time.Since(killAsked).Round(time.Millisecond))
	runsOf[1-li].wait(t, "the killed leader's Run to be cancelled", 5*time.Second, func(_ []Token, c []error) bool {
		return len(c) == 1 && errors.Is(c[0], ErrLeadershipLost)
	})
	runsOf[li].wait(t, "Run to start again on the survivor", 5*time.Second, func(s []Token, _ []error) bool { return len(s) == 2 && s[1] == tok3 })
	stale2 := e.fenced(TokenSourceFunc(func(context.Context) (Token, error) { return tok2, nil }))
	a = e.mustWrite(t, "a write with the dead leader's token", stale2, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"dead"}}`, 403)
	if !strings.Contains(a.message(), "stale token "+tok2.String()) {
		t.Fatalf("refused, but not as stale: %s", a.raw)
	}
	e.mustWrite(t, "the survivor's write", leaderRT, "PATCH", e.cmPath("inv"), "application/merge-patch+json", `{"data":{"v":"6"}}`, 200)
}
