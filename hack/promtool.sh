#!/usr/bin/env bash
# Prints the path of a promtool binary (Prometheus' rule checker), installing it first if needed.
#
#   hack/promtool.sh        -> e.g. ~/.cache/fencedlease/promtool/2.42.0+ds-5+deb12u1/promtool
#   "$(hack/promtool.sh)" check rules rules.yaml
#
# promtool comes from Debian's `prometheus` package, unpacked (`apt-get download` + `dpkg-deb
# -x`), not installed: installing it would start a Prometheus server. Cached in
# $FENCEDLEASE_CACHE/promtool/<package version>/ (default ~/.cache/fencedlease). Idempotent and
# safe to run concurrently. Progress goes to stderr; stdout carries only the path.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

DIR="$FL_CACHE/promtool"
works() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }

mkdir -p "$DIR" || die "cannot create $DIR: set FENCEDLEASE_CACHE to a writable folder"
existing="$(find "$DIR" -mindepth 2 -maxdepth 2 -name promtool -type f 2>/dev/null | head -n 1)"
if [ -n "$existing" ] && works "$existing"; then
  echo "$existing"
  exit 0
fi

# One installer at a time (test binaries may call this in parallel); the others wait, then reuse.
exec 9>"$DIR/.lock"
flock 9 || die "could not lock $DIR/.lock"
existing="$(find "$DIR" -mindepth 2 -maxdepth 2 -name promtool -type f 2>/dev/null | head -n 1)"
if [ -n "$existing" ] && works "$existing"; then
  echo "$existing"
  exit 0
fi

command -v apt-get >/dev/null ||
  die "apt-get not found: install promtool by hand (it ships with Prometheus) and put it at $DIR/<version>/promtool"
version="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}')"
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
  log "apt-get update (the package lists do not know the prometheus package yet)"
  apt-get update -q >"$DIR/apt-update.log" 2>&1 || die "apt-get update failed: see $DIR/apt-update.log"
  version="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}')"
fi
[ -n "$version" ] && [ "$version" != "(none)" ] ||
  die "Debian's package lists have no prometheus package: check /etc/apt/sources.list, or install promtool by hand at $DIR/<version>/promtool"

work="$(mktemp -d "$DIR/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log "fetching promtool: apt-get download prometheus=$version (about 30 MB)"
(cd "$work" && apt-get download -q "prometheus=$version" >"$work/download.log" 2>&1) || {
  cat "$work/download.log" >&2
  die "apt-get download prometheus=$version failed (see above): check that apt can reach its mirror"
}
deb="$(find "$work" -maxdepth 1 -name 'prometheus_*.deb' | head -n 1)"
[ -n "$deb" ] || die "apt-get download reported success but left no prometheus_*.deb in $work"
dpkg-deb -x "$deb" "$work/root" || die "could not unpack $deb"
[ -x "$work/root/usr/bin/promtool" ] || die "$deb holds no usr/bin/promtool: the package's layout changed"
works "$work/root/usr/bin/promtool" || die "the promtool from $deb does not run"

dest="$DIR/$version"
rm -rf "$dest.new"
mkdir -p "$dest.new"
mv "$work/root/usr/bin/promtool" "$dest.new/promtool"
rm -rf "$dest"
mv "$dest.new" "$dest"
log "$("$dest/promtool" --version 2>&1 | head -n 1) installed at $dest/promtool"
echo "$dest/promtool"
