package fencedlease

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

// DefaultURL is the sidecar API's address when neither the caller nor $FENCEDLEASE_URL names
// one (the injector's default port, 8787).
const DefaultURL = "http://127.0.0.1:8787"

// URLEnv is the environment variable the injector sets in every app container.
const URLEnv = "FENCEDLEASE_URL"

// SecretFileEnv names, in an injected pod's app containers, the file with the pod's API
// secret: the sidecar answers only requests that send it (see [Client.SecretFile]).
const SecretFileEnv = "FENCEDLEASE_API_SECRET_FILE"

// DefaultSecretFile is where the sidecar writes the pod's API secret in an injected pod (its
// token dir, /var/run/fencedlease).
const DefaultSecretFile = "/var/run/fencedlease/api-secret"

// maxSecretBytes bounds what the client reads of the secret file (the sidecar writes 65 bytes).
const maxSecretBytes = 4 << 10

// ErrUnauthorized is what the errors of requests the sidecar refused for want of the pod's API
// secret match with [errors.Is].
var ErrUnauthorized = errors.New("fencedlease: the sidecar wants the pod's API secret")

// maxResponseBytes bounds what the client reads of any one answer of the sidecar (a status is
// a few hundred bytes).
const maxResponseBytes = 64 << 10

// defaultRequestTimeout bounds a request whose context has no deadline: the sidecar answers
// from memory, on loopback.
const defaultRequestTimeout = 5 * time.Second

// Status is the JSON of /v1/status and of each /v1/watch event.
type Status struct {
	Lease     string `json:"lease"`
	Namespace string `json:"namespace"`
	// Identity is this candidate's identity (the pod's name).
	Identity string `json:"identity"`
	Leading  bool   `json:"leading"`
	// Token is the fencing token while leading, else nil.
	Token *int64 `json:"token"`
	// LeaseUID is the lease's UID while leading (sent with the token), else nil.
	LeaseUID *string `json:"leaseUID"`
	// Holder is the current holder as far as this sidecar knows (nil when nobody, or not
	// known yet).
	Holder *string `json:"holder"`
	// TimeLeftMs is, while leading, the milliseconds until leadership ends unless renewed.
	TimeLeftMs *uint64 `json:"timeLeftMs"`
	AppHealthy bool    `json:"appHealthy"`
}

// LeadingToken is the token while the status says this pod leads.
func (s Status) LeadingToken() (Token, bool) {
	if !s.Leading || s.Token == nil || s.LeaseUID == nil {
		return Token{}, false
	}
	return Token{Value: *s.Token, LeaseUID: *s.LeaseUID}, true
}

// HolderName is the holder, or "" when nobody holds the lease (or it is not known yet).
func (s Status) HolderName() string {
	if s.Holder == nil {
		return ""
	}
	return *s.Holder
}

// Token is what a write to a protected object presents: the lease's generation and the
// lease's UID (tokens restart when a lease is deleted and created again).
type Token struct {
	Value    int64  `json:"token"`
	LeaseUID string `json:"leaseUID"`
}

// String is the token as the fencedlease.io/token annotation carries it.
func (t Token) String() string { return strconv.FormatInt(t.Value, 10) }

// A TokenSource hands out the current token, or an error (a [*NotLeadingError] when this pod
// does not lead). [*Client] and [TokenFiles] are TokenSources.
type TokenSource interface {
	Token(ctx context.Context) (Token, error)
}

// TokenSourceFunc turns a function into a TokenSource.
type TokenSourceFunc func(ctx context.Context) (Token, error)

// Token calls f.
func (f TokenSourceFunc) Token(ctx context.Context) (Token, error) { return f(ctx) }

// ErrNotLeading matches (errors.Is) every [*NotLeadingError].
var ErrNotLeading = errors.New("fencedlease: this pod does not lead the lease")

// NotLeadingError says that this pod does not lead, and who does if known.
type NotLeadingError struct {
	// Holder is the current holder as far as the sidecar knows ("" when nobody or unknown).
	Holder string
	// Source names where this was learnt (the sidecar's URL, a token folder).
	Source string
}

func (e *NotLeadingError) Error() string {
	who := "no holder known"
	if e.Holder != "" {
		who = "it is held by " + strconv.Quote(e.Holder)
	}
	return fmt.Sprintf("fencedlease: this pod does not lead the lease (%s; from %s): do not write to protected objects; wait for leadership (Client.Watch or Runnable)", who, e.Source)
}

// Is makes errors.Is(err, ErrNotLeading) true.
func (e *NotLeadingError) Is(target error) bool { return target == ErrNotLeading }

// Client talks to the sidecar's loopback API. The zero value is not usable: use [NewClient].
type Client struct {
	base *url.URL
	// HTTPClient sends the requests (http.DefaultClient when nil). Its Timeout, if any, also
	// cuts Watch streams; leave it zero and use contexts.
	HTTPClient *http.Client
	// WatchIdleTimeout is how long a [Client.Watch] stream may stay silent (no status, no
	// keep-alive) before it is taken for dead and reconnected; 0 means
	// [DefaultWatchIdleTimeout].
	WatchIdleTimeout time.Duration
	// SecretFile is the file with the pod's API secret, sent as a bearer token with every
	// request: the sidecar's loopback is reachable by `kubectl port-forward`, so it answers
	// only callers that can read the pod's token volume. [NewClient] sets it from
	// $FENCEDLEASE_API_SECRET_FILE, else [DefaultSecretFile]. It is read afresh for every
	// request; while it does not exist, requests go without it (and are refused, with
	// [ErrUnauthorized]).
	SecretFile string
}

// NewClient returns a client of the sidecar at baseURL; with baseURL "", at $FENCEDLEASE_URL,
// else at [DefaultURL].
func NewClient(baseURL string) (*Client, error) {
	from := "the baseURL argument"
	if baseURL == "" {
		baseURL, from = os.Getenv(URLEnv), "$"+URLEnv
	}
	if baseURL == "" {
		baseURL, from = DefaultURL, "the default"
	}
	u, err := url.Parse(baseURL)
	if err != nil || u.Scheme != "http" || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("fencedlease: sidecar URL %q (from %s) is not of the form http://HOST:PORT: set %s to the sidecar's address, e.g. %s", baseURL, from, URLEnv, DefaultURL)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	secret := os.Getenv(SecretFileEnv)
	if secret == "" {
		secret = DefaultSecretFile
	}
	return &Client{base: u, SecretFile: secret}, nil
}

// authorize adds the pod's API secret to req, when the secret file exists.
func (c *Client) authorize(req *http.Request) error {
	if c.SecretFile == "" {
		return nil
	}
	f, err := os.Open(c.SecretFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("fencedlease: reading the pod's API secret: %w (set $%s to the file the sidecar writes, its token dir's api-secret)", err, SecretFileEnv)
	}
	defer f.Close()
	secret, err := readBounded(f, maxSecretBytes)
	if err != nil {
		return fmt.Errorf("fencedlease: reading the pod's API secret %s: %w", c.SecretFile, err)
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(secret)))
	return nil
}

// refused is the error of a 401 answer: the request went without the right secret.
func (c *Client) refused(op string, body []byte) error {
	return fmt.Errorf("%w: %s: %s refused the request: %s (the client sends the contents of SecretFile, %q; in an injected pod $%s names the file)", ErrUnauthorized, op, c.base, excerpt(body), c.SecretFile, SecretFileEnv)
}

// URL is the sidecar's base URL.
func (c *Client) URL() string { return c.base.String() }

func (c *Client) httpClient() *http.Client {
	if c.HTTPClient != nil {
		return c.HTTPClient
	}
	return http.DefaultClient
}

func (c *Client) endpoint(path string) string { return c.base.String() + path }

// unreachable wraps a transport error with what to check.
func (c *Client) unreachable(op string, err error) error {
	return fmt.Errorf("fencedlease: %s: the sidecar at %s does not answer (is the fencedlease container running? look at its log; in an injected pod $%s names its address): %w", op, c.base, URLEnv, err)
}

// readBounded reads at most limit bytes of r; more is an error.
func readBounded(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("the answer is larger than %d bytes", limit)
	}
	return b, nil
}

// excerpt is the start of a body for an error message.
func excerpt(b []byte) string {
	const n = 200
	s := strings.TrimSpace(string(b))
	if len(s) > n {
		s = s[:n] + "…"
	}
	return strconv.Quote(s)
}

// do sends one short request and returns the status code and the (bounded) body.
func (c *Client) do(ctx context.Context, op, method, path string) (int, []byte, error) {
	return c.doBody(ctx, op, method, path, nil)
}

// doBody is do with a JSON request body (none when nil).
func (c *Client) doBody(ctx context.Context, op, method, path string, body []byte) (int, []byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultRequestTimeout)
		defer cancel()
	}
	var reader io.Reader
	if body != nil {
		reader = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.endpoint(path), reader)
	if err != nil {
		return 0, nil, fmt.Errorf("fencedlease: %s: %w", op, err)
	}
	req.Header.Set("Accept", "application/json")
	if err := c.authorize(req); err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		return 0, nil, c.unreachable(op, err)
	}
	defer resp.Body.Close()
	answer, err := readBounded(resp.Body, maxResponseBytes)
	if err != nil {
		return 0, nil, fmt.Errorf("fencedlease: %s: reading the answer of %s: %w", op, c.base, err)
	}
	return resp.StatusCode, answer, nil
}

// unexpected describes an answer the sidecar should not give.
func (c *Client) unexpected(op string, code int, body []byte) error {
	if code == http.StatusUnauthorized {
		return c.refused(op, body)
	}
	return fmt.Errorf("fencedlease: %s: unexpected answer %d from %s: %s (is %s really a fencedlease sidecar, of a version that serves /v1?)", op, code, c.base, excerpt(body), c.base)
}

// Status asks the sidecar for its view of the lease.
func (c *Client) Status(ctx context.Context) (Status, error) {
	const op = "GET /v1/status"
	code, body, err := c.do(ctx, op, http.MethodGet, "/v1/status")
	if err != nil {
		return Status{}, err
	}
	if code != http.StatusOK {
		return Status{}, c.unexpected(op, code, body)
	}
	var st Status
	if err := json.Unmarshal(body, &st); err != nil {
		return Status{}, fmt.Errorf("fencedlease: %s: the answer is not a status: %v: %s", op, err, excerpt(body))
	}
	return st, nil
}

// Token asks the sidecar for the current token. When this pod does not lead the error is a
// [*NotLeadingError] (errors.Is(err, ErrNotLeading)). Ask again before every write (it is a
// loopback request answered from memory) rather than keeping the token: a kept token goes
// stale when leadership moves, and the webhook then refuses the writes that present it.
func (c *Client) Token(ctx context.Context) (Token, error) {
	const op = "GET /v1/token"
	code, body, err := c.do(ctx, op, http.MethodGet, "/v1/token")
	if err != nil {
		return Token{}, err
	}
	switch code {
	case http.StatusOK:
		var t struct {
			Token    *int64  `json:"token"`
			LeaseUID *string `json:"leaseUID"`
		}
		if err := json.Unmarshal(body, &t); err != nil || t.Token == nil || t.LeaseUID == nil || *t.Token <= 0 || *t.LeaseUID == "" {
			return Token{}, fmt.Errorf("fencedlease: %s: the answer is not a token: %s", op, excerpt(body))
		}
		return Token{Value: *t.Token, LeaseUID: *t.LeaseUID}, nil
	case http.StatusConflict:
		var nl struct {
			Holder *string `json:"holder"`
		}
		if err := json.Unmarshal(body, &nl); err != nil {
			return Token{}, c.unexpected(op, code, body)
		}
		e := &NotLeadingError{Source: c.base.String()}
		if nl.Holder != nil {
			e.Holder = *nl.Holder
		}
		return Token{}, e
	default:
		return Token{}, c.unexpected(op, code, body)
	}
}

// Release asks the sidecar to step down now. It answers at once; leadership ends a moment
// later (watch for it), and this pod stays out of the election for one lease duration.
func (c *Client) Release(ctx context.Context) error {
	const op = "POST /v1/release"
	code, body, err := c.do(ctx, op, http.MethodPost, "/v1/release")
	if err != nil {
		return err
	}
	if code != http.StatusAccepted {
		return c.unexpected(op, code, body)
	}
	return nil
}

// ErrNotCurrent is what Acknowledge returns when the token is not the tenure this pod leads in.
var ErrNotCurrent = errors.New("fencedlease: not the current tenure's token")

// Acknowledge tells the sidecar that this process knows it leads with tok (POST
// /v1/acknowledge). After the lease was lost and acquired again, the sidecar's API proxy sends
// writes without a pin only once the app has acknowledged the new tenure: a write decided
// before the loss would otherwise go out under the new token. [Runnable] acknowledges each term
// as it starts. A tok that is not the current tenure's gives an error wrapping [ErrNotCurrent].
func (c *Client) Acknowledge(ctx context.Context, tok Token) error {
	const op = "POST /v1/acknowledge"
	body, err := json.Marshal(map[string]any{"token": tok.Value, "leaseUID": tok.LeaseUID})
	if err != nil {
		return fmt.Errorf("fencedlease: %s: %w", op, err)
	}
	code, answer, err := c.doBody(ctx, op, http.MethodPost, "/v1/acknowledge", body)
	if err != nil {
		return err
	}
	switch code {
	case http.StatusOK:
		return nil
	case http.StatusConflict:
		return fmt.Errorf("%w: %s: %s", ErrNotCurrent, op, excerpt(answer))
	default:
		return c.unexpected(op, code, answer)
	}
}

// decodeStatus parses one event's data.
func decodeStatus(data []byte) (Status, error) {
	var st Status
	if !bytes.HasPrefix(bytes.TrimSpace(data), []byte("{")) {
		return Status{}, fmt.Errorf("fencedlease: a /v1/watch event is not a status object: %s", excerpt(data))
	}
	if err := json.Unmarshal(data, &st); err != nil {
		return Status{}, fmt.Errorf("fencedlease: a /v1/watch event is not a status: %v: %s", err, excerpt(data))
	}
	return st, nil
}
