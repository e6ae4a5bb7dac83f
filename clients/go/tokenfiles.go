package fencedlease

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// TokenFileEnv is the environment variable the injector sets to the token file's path (the
// lease UID file, lease-uid, is beside it).
const TokenFileEnv = "FENCEDLEASE_TOKEN_FILE"

// DefaultTokenDir is where the injected sidecar keeps the token files.
const DefaultTokenDir = "/var/run/fencedlease"

// maxTokenFileBytes bounds what is read of a token file (a token is at most 20 digits, a UID
// 36 characters).
const maxTokenFileBytes = 1024

// TokenFiles reads the files the sidecar keeps in its token folder: "token" and "lease-uid",
// written atomically while the pod leads and removed when it stops. Between a sidecar crash and
// its restart the files of the crashed run are still there, so treat them as a hint and the
// sidecar's API (or the webhook) as the truth.
type TokenFiles struct {
	Dir string
}

// TokenFilesFromEnv is the token folder of an injected pod: the folder of $FENCEDLEASE_TOKEN_FILE,
// else [DefaultTokenDir].
func TokenFilesFromEnv() TokenFiles {
	if f := os.Getenv(TokenFileEnv); f != "" {
		return TokenFiles{Dir: filepath.Dir(f)}
	}
	return TokenFiles{Dir: DefaultTokenDir}
}

// Token reads the token and the lease UID. When the token file is absent the pod does not lead
// and the error is a [*NotLeadingError]. ctx is not used (reading two small files does not
// block); it makes TokenFiles a [TokenSource].
func (f TokenFiles) Token(_ context.Context) (Token, error) {
	// The sidecar writes lease-uid before token and removes token first. Reading token, then
	// lease-uid, then token again, and retrying when the two token reads differ, pairs a token
	// with its own lease UID even across a change of leadership between the reads.
	for range 3 {
		t1, err := f.read("token")
		if err != nil {
			return Token{}, err
		}
		uid, err := f.read("lease-uid")
		if err != nil {
			return Token{}, err
		}
		t2, err := f.read("token")
		if err != nil {
			return Token{}, err
		}
		if t1 != t2 {
			continue
		}
		v, err := parseToken(t1)
		if err != nil {
			return Token{}, fmt.Errorf("fencedlease: %s: %v; the sidecar writes a positive decimal: is another process writing this folder?", filepath.Join(f.Dir, "token"), err)
		}
		if uid == "" {
			return Token{}, fmt.Errorf("fencedlease: %s is empty; the sidecar writes the lease UID there: is another process writing this folder?", filepath.Join(f.Dir, "lease-uid"))
		}
		return Token{Value: v, LeaseUID: uid}, nil
	}
	return Token{}, fmt.Errorf("fencedlease: the token in %s kept changing while it was read; leadership is moving: try again", f.Dir)
}

// read returns a file's content without its line end; a missing file means not leading.
func (f TokenFiles) read(name string) (string, error) {
	path := filepath.Join(f.Dir, name)
	file, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		if _, derr := os.Stat(f.Dir); errors.Is(derr, fs.ErrNotExist) {
			// A sidecar that never led has not created its --token-dir yet; in an injected
			// pod the folder is a mounted volume, so its absence there is a missing mount.
			return "", &NotLeadingError{Source: "the token files in " + f.Dir + ", a folder that does not exist: the sidecar creates it when it first leads (in an injected pod, mount the sidecar's token volume, or set $" + TokenFileEnv + ")"}
		} else if derr != nil {
			return "", fmt.Errorf("fencedlease: the token folder %s cannot be read: %w", f.Dir, derr)
		}
		return "", &NotLeadingError{Source: "the token files in " + f.Dir}
	}
	if err != nil {
		return "", fmt.Errorf("fencedlease: reading %s: %w", path, err)
	}
	defer file.Close()
	b, err := readBounded(file, maxTokenFileBytes)
	if err != nil {
		return "", fmt.Errorf("fencedlease: reading %s: %w", path, err)
	}
	return strings.TrimSuffix(string(b), "\n"), nil
}

// parseToken accepts what the webhook accepts: a canonical positive decimal that fits int64.
func parseToken(s string) (int64, error) {
	if s == "" || s[0] == '0' || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a token", s)
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a token (it does not fit 64 bits)", s)
	}
	return v, nil
}
