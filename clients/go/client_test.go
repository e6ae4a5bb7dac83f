package fencedlease

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestStatusAndToken(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(7, "uid-1", 10*time.Second))
	ctx := context.Background()
	st, err := f.client.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Leading || *st.Token != 7 || *st.LeaseUID != "uid-1" || st.HolderName() != "pod-a" || *st.TimeLeftMs != 10000 {
		t.Fatalf("status %+v", st)
	}
	tok, err := f.client.Token(ctx)
	if err != nil || tok != (Token{Value: 7, LeaseUID: "uid-1"}) {
		t.Fatalf("token %+v, %v", tok, err)
	}
	if tok.String() != "7" {
		t.Fatalf("token string %q", tok.String())
	}

	f.set(followingStatus("pod-b"))
	_, err = f.client.Token(ctx)
	if !errors.Is(err, ErrNotLeading) {
		t.Fatalf("not leading must match ErrNotLeading: %v", err)
	}
	var nl *NotLeadingError
	if !errors.As(err, &nl) || nl.Holder != "pod-b" || nl.Source != f.srv.URL {
		t.Fatalf("NotLeadingError %+v", nl)
	}
	if !strings.Contains(err.Error(), `held by "pod-b"`) || !strings.Contains(err.Error(), "do not write") {
		t.Fatalf("message: %v", err)
	}
	f.set(followingStatus(""))
	_, err = f.client.Token(ctx)
	if !errors.As(err, &nl) || nl.Holder != "" || !strings.Contains(err.Error(), "no holder known") {
		t.Fatalf("no holder: %v", err)
	}
}

func TestRelease(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(7, "uid-1", time.Second))
	if err := f.client.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n, _ := f.counts(); n != 1 {
		t.Fatalf("releases: %d", n)
	}
}

// server answers every request with code and body.
func server(t *testing.T, code int, body string) *Client {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(code)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	c, err := NewClient(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestUnexpectedAnswersAreErrorsThatSaySo(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, body string
		code       int
		call       func(*Client) error
		want       string
	}{
		{"token garbage", `{"token":"x"}`, 200, func(c *Client) error { _, err := c.Token(ctx); return err }, "not a token"},
		{"token zero", `{"token":0,"leaseUID":"u"}`, 200, func(c *Client) error { _, err := c.Token(ctx); return err }, "not a token"},
		{"token no uid", `{"token":3}`, 200, func(c *Client) error { _, err := c.Token(ctx); return err }, "not a token"},
		{"token 500", `boom`, 500, func(c *Client) error { _, err := c.Token(ctx); return err }, "unexpected answer 500"},
		{"token 409 not json", `busy`, 409, func(c *Client) error { _, err := c.Token(ctx); return err }, "unexpected answer 409"},
		{"status 404", `nope`, 404, func(c *Client) error { _, err := c.Status(ctx); return err }, "unexpected answer 404"},
		{"status not json", `<html>`, 200, func(c *Client) error { _, err := c.Status(ctx); return err }, "not a status"},
		{"status too large", `{"lease":"` + strings.Repeat("x", maxResponseBytes) + `"}`, 200, func(c *Client) error { _, err := c.Status(ctx); return err }, "larger than"},
		{"release 200", `{}`, 200, func(c *Client) error { return c.Release(ctx) }, "unexpected answer 200"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call(server(t, tc.code, tc.body))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want an error with %q, got %v", tc.want, err)
			}
			if errors.Is(err, ErrNotLeading) {
				t.Fatalf("a broken answer is not 'not leading': %v", err)
			}
		})
	}
}

func TestAnAbsentSidecarSaysWhatToCheck(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close() // nothing listens there now
	c, err := NewClient(url)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Token(context.Background())
	if err == nil || !strings.Contains(err.Error(), "does not answer") || !strings.Contains(err.Error(), "fencedlease container") {
		t.Fatalf("%v", err)
	}
	if errors.Is(err, ErrNotLeading) {
		t.Fatalf("an absent sidecar is not 'not leading': %v", err)
	}
}

func TestNewClientTakesTheEnvironmentAndRefusesBadURLs(t *testing.T) {
	t.Setenv(URLEnv, "")
	c, err := NewClient("")
	if err != nil || c.URL() != DefaultURL {
		t.Fatalf("default: %v %v", c, err)
	}
	t.Setenv(URLEnv, "http://127.0.0.1:9999/")
	c, err = NewClient("")
	if err != nil || c.URL() != "http://127.0.0.1:9999" {
		t.Fatalf("env: %v %v", c, err)
	}
	c, err = NewClient("http://[::1]:8787")
	if err != nil || c.URL() != "http://[::1]:8787" {
		t.Fatalf("explicit: %v %v", c, err)
	}
	for _, bad := range []string{"https://127.0.0.1:8787", "127.0.0.1:8787", "http://", "http://u:p@h:1", "http://h:1?x=1", "::"} {
		_, err := NewClient(bad)
		if err == nil || !strings.Contains(err.Error(), URLEnv) {
			t.Errorf("%q: want an error naming %s, got %v", bad, URLEnv, err)
		}
	}
	t.Setenv(URLEnv, "localhost:8787")
	if _, err := NewClient(""); err == nil || !strings.Contains(err.Error(), "from $"+URLEnv) {
		t.Errorf("a bad $%s must be named as the source: %v", URLEnv, err)
	}
}

// The sidecar answers only requests with the pod's API secret: the client sends the file's
// contents; without the file, or with another secret, every call fails with ErrUnauthorized
// and says which file it read.
func TestTheClientSendsThePodsSecret(t *testing.T) {
	f := newFakeSidecar(t, leadingStatus(7, "uid-1", 10*time.Second))
	ctx := context.Background()
	if _, err := f.client.Token(ctx); err != nil {
		t.Fatalf("with the secret: %v", err)
	}
	t.Setenv(SecretFileEnv, f.secretFile)
	fromEnv, err := NewClient(f.srv.URL)
	if err != nil || fromEnv.SecretFile != f.secretFile {
		t.Fatalf("SecretFile from $%s: %q, %v", SecretFileEnv, fromEnv.SecretFile, err)
	}
	wrong := filepath.Join(t.TempDir(), "api-secret")
	if err := os.WriteFile(wrong, []byte(strings.Repeat("0", 64)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, file := range []string{filepath.Join(t.TempDir(), "absent"), wrong} {
		c := *f.client
		c.SecretFile = file
		_, errToken := c.Token(ctx)
		_, errStatus := c.Status(ctx)
		errRelease := c.Release(ctx)
		var errWatch error
		for _, err := range c.Watch(ctx) {
			errWatch = err
			break
		}
		for what, err := range map[string]error{"Token": errToken, "Status": errStatus, "Release": errRelease, "Watch": errWatch} {
			if !errors.Is(err, ErrUnauthorized) || !strings.Contains(err.Error(), file) {
				t.Fatalf("%s with secret file %s: want ErrUnauthorized naming the file, got %v", what, file, err)
			}
		}
	}
}
