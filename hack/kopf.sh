#!/usr/bin/env bash
# Installs kopf (the Python operator framework) once, for the kopf sample operator
# (clients/python/examples/kopf_operator.py) and its test (tests/adoption_kopf.rs), and prints
# the Python to run it with.
#
#   hack/kopf.sh            install if missing, then print the venv's python
#
# kopf 1.45.2 and what it needs come from the Python package registry into a virtual
# environment in the cache outside the repository ($FENCEDLEASE_CACHE/kopf-1.45.2, default
# ~/.cache/fencedlease); later runs take a moment. The fencedlease client itself is not
# installed there: the sample finds it in clients/python/src.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

VERSION=1.45.2
ROOT="$FL_CACHE/kopf-$VERSION"
PY="$ROOT/venv/bin/python"

works() { [ -x "$PY" ] && "$PY" -c "import kopf, sys; sys.exit(kopf.__version__ != '$VERSION')" 2>/dev/null; }

if ! works; then
  mkdir -p "$ROOT" || die "cannot create $ROOT: set FENCEDLEASE_CACHE to a writable folder"
  exec 9>"$ROOT/.install.lock"
  if ! flock -n 9; then
    log "another install of kopf $VERSION is running (lock: $ROOT/.install.lock); waiting for it" >&2
    flock 9
  fi
  if ! works; then
    command -v python3 >/dev/null || die "python3 not found: install Python 3.9 or later, then rerun"
    rm -rf "$ROOT/venv"
    log "installing kopf $VERSION into $ROOT/venv (once; log: $ROOT/install.log)" >&2
    python3 -m venv "$ROOT/venv" >"$ROOT/install.log" 2>&1 ||
      die "python3 -m venv failed (log: $ROOT/install.log): install Python's venv module (Debian: python3-venv), then rerun"
    with_heartbeat "pip install kopf==$VERSION" "$ROOT/install.log" \
      "$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check "kopf==$VERSION" >&2 ||
      die "installing kopf failed (log: $ROOT/install.log); check that the Python package registry is reachable, then rerun"
    works || die "kopf $VERSION is not importable after installing it (log: $ROOT/install.log)"
  fi
fi
echo "$PY"
