package fencedlease

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTokenFiles(t *testing.T) {
	dir := t.TempDir()
	files := TokenFiles{Dir: dir}
	ctx := context.Background()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Not leading: no files (the sidecar removes them).
	if _, err := files.Token(ctx); !errors.Is(err, ErrNotLeading) || !strings.Contains(err.Error(), dir) {
		t.Fatalf("no files: %v", err)
	}
	write("lease-uid", "uid-1\n")
	write("token", "12\n")
	tok, err := files.Token(ctx)
	if err != nil || tok != (Token{Value: 12, LeaseUID: "uid-1"}) {
		t.Fatalf("%+v %v", tok, err)
	}
	for _, bad := range []string{"012\n", "+1\n", "-1\n", "1x\n", "\n", "99999999999999999999\n", " 1\n"} {
		write("token", bad)
		if _, err := files.Token(ctx); err == nil || errors.Is(err, ErrNotLeading) || !strings.Contains(err.Error(), "not a token") {
			t.Errorf("token file %q: %v", bad, err)
		}
	}
	write("token", "12\n")
	write("lease-uid", "")
	if _, err := files.Token(ctx); err == nil || !strings.Contains(err.Error(), "lease-uid is empty") {
		t.Errorf("empty uid: %v", err)
	}
	write("lease-uid", strings.Repeat("u", maxTokenFileBytes+1))
	if _, err := files.Token(ctx); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("huge uid: %v", err)
	}
	// A folder that is not there: the sidecar has not led yet (it creates it then), or the
	// pod lacks the mount; the message says both.
	_, err = TokenFiles{Dir: filepath.Join(dir, "absent")}.Token(ctx)
	if !errors.Is(err, ErrNotLeading) || !strings.Contains(err.Error(), "mount the sidecar's token volume") {
		t.Errorf("absent folder: %v", err)
	}
}

func TestTokenFilesFromEnv(t *testing.T) {
	t.Setenv(TokenFileEnv, "/x/y/token")
	if d := TokenFilesFromEnv().Dir; d != "/x/y" {
		t.Fatal(d)
	}
	t.Setenv(TokenFileEnv, "")
	if d := TokenFilesFromEnv().Dir; d != DefaultTokenDir {
		t.Fatal(d)
	}
}
