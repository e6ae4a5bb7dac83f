# Shared helpers for the hack/ scripts. Source it; do not run it.
# shellcheck shell=bash

# Kubernetes versions (hack/k8s-binaries.sh builds them, hack/cluster.sh starts them):
# the default is the newest release that builds from the Go modules and runs here; the legacy one
# is the oldest we support, built from Debian's source package.
FL_K8S_DEFAULT_VERSION=1.37.2
FL_K8S_LEGACY_VERSION=1.20.2
FL_K8S_VERSION="${FL_K8S_VERSION:-$FL_K8S_DEFAULT_VERSION}"
FL_CACHE="${FENCEDLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fencedlease}"
FL_CLUSTER_DIR="${FENCEDLEASE_CLUSTER_DIR:-/tmp/fencedlease-cluster}"
FL_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The test bed's OCI registry (hack/registry.sh): plain HTTP on loopback. The node's containerd
# (hack/node.sh) is told to pull from it over HTTP; hack/release.sh pushes to it.
FL_REGISTRY="${FENCEDLEASE_REGISTRY:-127.0.0.1:5151}"

# The previous release, which the upgrade test (tests/release.rs) installs before upgrading to
# this tree: its version, and the commit its tag v$FL_PREVIOUS_VERSION points at (kept here too,
# since a clone may come without tags).
FL_PREVIOUS_VERSION=0.1.0
FL_PREVIOUS_COMMIT=d2ff91af05f8fe9bf2cf1c79e91966f41ab62b07

# fl_version: the project's one version (Cargo.toml's [workspace.package] version).
fl_version() { sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$FL_REPO/Cargo.toml"; }

# log MESSAGE...: a timestamped progress line on stderr.
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# die MESSAGE...: print what went wrong (and what to do) and stop.
die() { printf '[%s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

# with_heartbeat LABEL LOGFILE CMD...: run CMD with its output in LOGFILE, printing a line every
# 30 s so that nobody sits in front of a silent terminal. On failure, show the log's tail.
with_heartbeat() {
  local label="$1" logfile="$2"; shift 2
  local start=$SECONDS
  "$@" >"$logfile" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 30); do sleep 1; kill -0 "$pid" 2>/dev/null || break; done
    kill -0 "$pid" 2>/dev/null && log "$label: still running ($((SECONDS - start)) s; log: $logfile)"
  done
  if ! wait "$pid"; then
    tail -n 30 "$logfile" >&2
    die "$label failed after $((SECONDS - start)) s; full log: $logfile"
  fi
  log "$label: done in $((SECONDS - start)) s"
}

# need_disk GIB WHY PATH: stop, saying what to do, when the filesystem holding PATH (or its nearest
# existing parent) has less than GIB GiB free; a full disk otherwise shows up minutes later as a
# linker's bus error or "No space left on device" in the middle of a build.
need_disk() {
  local gib="$1" why="$2" path="$3" free
  while [ ! -e "$path" ]; do path=$(dirname "$path"); done
  free=$(df -Pk "$path" | awk 'NR == 2 { print int($4 / 1048576) }')
  [ "$free" -ge "$gib" ] ||
    die "only $free GiB free on the filesystem of $path; $why needs about $gib GiB: free some (cargo clean in other checkouts, old /tmp/fencedlease-* folders) and rerun"
  log "disk: $free GiB free on the filesystem of $path ($why needs about $gib GiB)"
}

# alive PID: the process exists and is not a zombie waiting for its parent to reap it.
alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; }

# stop_pid NAME PID: SIGTERM, up to 10 s to exit, then SIGKILL and up to 5 s more.
stop_pid() {
  local name="$1" pid="$2"
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$pid" || return 0; sleep 0.1; done
  log "$name (pid $pid) did not stop within 10 s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
}

# wait_for LABEL TIMEOUT_S LOGFILE PIDFILE HINT CMD...: wait until CMD succeeds (tried every
# 0.5 s, its output discarded), with a progress line every 10 s. It fails, showing LOGFILE's tail
# and saying what to do (HINT, e.g. "hack/cluster.sh down && hack/cluster.sh up"), when TIMEOUT_S
# have passed, and at once when the process whose pid is in PIDFILE has exited (a port taken, a
# bad flag: waiting longer would not help). PIDFILE may be "" when there is no process to watch.
wait_for() {
  local label="$1" timeout="$2" logfile="$3" pidfile="$4" hint="$5"; shift 5
  local start=$SECONDS next=10 pid
  until "$@" >/dev/null 2>&1; do
    if [ -n "$pidfile" ] && [ -f "$pidfile" ]; then
      pid=$(cat "$pidfile")
      if ! alive "$pid"; then
        tail -n 25 "$logfile" >&2 || true
        die "$label: its process (pid $pid, $pidfile) exited during start-up after $((SECONDS - start)) s; log: $logfile (fix what it says above, then: $hint)"
      fi
    fi
    if [ $((SECONDS - start)) -ge "$timeout" ]; then
      tail -n 25 "$logfile" >&2 || true
      die "$label did not become ready within $timeout s; log: $logfile (try: $hint)"
    fi
    if [ $((SECONDS - start)) -ge $next ]; then
      log "waiting for $label ($((SECONDS - start)) s)"
      next=$((next + 10))
    fi
    sleep 0.5
  done
  log "$label ready after $((SECONDS - start)) s"
}

# use_go_for_k8s_1_20: put Debian's Go 1.19 first on PATH (installing it if missing). The 1.20
# tree builds in GOPATH mode and breaks under newer Go, which may come first on PATH (the
# machine's /usr/local/go); GOTOOLCHAIN=local keeps Go from fetching another toolchain.
use_go_for_k8s_1_20() {
  apt_install golang-1.19-go rsync
  [ -x /usr/lib/go-1.19/bin/go ] || die "golang-1.19-go installed but /usr/lib/go-1.19/bin/go is missing"
  export PATH="/usr/lib/go-1.19/bin:$PATH" GOTOOLCHAIN=local
}

# apt_install PKG...: install Debian packages that are missing (needs root on Debian).
apt_install() {
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get: install them by hand"
  [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]}: run as root, or install them first"
  log "installing Debian packages: ${missing[*]}"
  if [ ! -f "$FL_CACHE/.apt-updated" ] || [ -n "$(find "$FL_CACHE/.apt-updated" -mmin +720)" ]; then
    mkdir -p "$FL_CACHE"
    with_heartbeat "apt-get update" "$FL_CACHE/apt-update.log" apt-get update -q
    touch "$FL_CACHE/.apt-updated"
  fi
  with_heartbeat "apt-get install" "$FL_CACHE/apt-install.log" \
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# binary_minor KUBE_BINARY: the minor version the binary reports ("Kubernetes v1.37.2" -> 37).
binary_minor() {
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^Kubernetes v1\.\([0-9][0-9]*\)\..*/\1/p')
  [ -n "$v" ] || die "$1 --version does not say 'Kubernetes v1.N...' (it says: $("$1" --version 2>&1 | head -n1)); a build without version stamps? remove its folder and rerun hack/k8s-binaries.sh"
  echo "$v"
}

# The sidecar's build (Cargo.toml: the workload-side commands only, no `operator` feature) for a
# PROFILE of release or debug: its cargo profile (sidecar: optimized for size; sidecar-dev: for the
# tests and CI, unoptimized), each in a folder of its own under target/, so that it never
# replaces the default build's binary.
sidecar_profile() { if [ "$1" = release ]; then echo sidecar; else echo sidecar-dev; fi; }
# Prints the path of the sidecar's build's binary for PROFILE (release or debug).
sidecar_binary() { echo "${CARGO_TARGET_DIR:-$FL_REPO/target}/$(sidecar_profile "$1")/fencedlease"; }
# Builds it (cargo, under with_build_lock).
build_sidecar() { with_build_lock cargo build --profile "$(sidecar_profile "$1")" --no-default-features; }

# with_build_lock CMD...: run CMD, holding the lock file $FL_BUILD_LOCK (flock) if it is set, so that
# on a machine shared by several builders (say FL_BUILD_LOCK=/tmp/fl-build.lock) one build runs at a
# time. The benchmarks' builds (cargo, go) go through it; unset, CMD just runs.
with_build_lock() {
  if [ -n "${FL_BUILD_LOCK:-}" ]; then
    flock "$FL_BUILD_LOCK" "$@"
  else
    "$@"
  fi
}
