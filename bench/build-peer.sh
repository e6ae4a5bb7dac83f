#!/usr/bin/env bash
# Builds the peer for the benchmarks: client-go's leader-election example from the Kubernetes
# v1.20.2 source tree that hack/k8s-binaries.sh unpacked, with three changes made at build time
# (nothing of it is kept in this repository):
#   - its timings become flags (-lease-duration, -renew-deadline, -retry-period; defaults are
#     client-go's usual 15s/10s/2s) so that it runs with the same lease duration as fencedlease;
#     the example as shipped in v1.20.2 hard-codes 60s/15s/5s;
#   - -events-file F: one JSON line {t_ns, identity, event} when it starts leading (OnStartedLeading)
#     and when it stops (OnStoppedLeading), the same shape as `fencedlease campaign --events-file`;
#   - nothing else: same LeaseLock, ReleaseOnCancel: true, same callbacks.
# Output: $FL_BENCH_CACHE/leader-election-peer (default ~/.cache/fencedlease/bench). Prints its path.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/lib.sh
source "$HERE/../hack/lib.sh"
# The benchmarks build from Kubernetes v1.20.2's source tree (Debian's package), which only the
# legacy build unpacks, and their recorded results are on that release: pin it (exported, so
# that hack/k8s-binaries.sh builds the same one).
FL_K8S_VERSION="$FL_K8S_LEGACY_VERSION"
export FL_K8S_VERSION

TREE="$FL_CACHE/k8s-$FL_K8S_VERSION/src/kubernetes"
OUT_DIR="${FL_BENCH_CACHE:-$FL_CACHE/bench}"
BIN="$OUT_DIR/leader-election-peer"
SRC="$TREE/staging/src/k8s.io/client-go/examples/leader-election/main.go"

if [ ! -f "$SRC" ]; then
  # hack/k8s-binaries.sh unpacks the tree on first use (and builds the control plane).
  "$HERE/../hack/k8s-binaries.sh" >/dev/null
fi
[ -f "$SRC" ] || die "the Kubernetes v$FL_K8S_VERSION source tree is missing ($TREE): hack/k8s-binaries.sh unpacks it when it builds the control plane, which it skips when KUBEBUILDER_ASSETS is set or $FL_CACHE/k8s-$FL_K8S_VERSION/bin is complete; unset KUBEBUILDER_ASSETS or move that bin folder away and run again"
use_go_for_k8s_1_20

GOPATH_DIR="$OUT_DIR/gopath"
PKG="$GOPATH_DIR/src/k8s.io/kubernetes/fencedlease-bench-peer"
mkdir -p "$PKG"
# A GOPATH whose k8s.io/kubernetes shares the tree's vendor/ (and staging/, which vendor links to).
for d in vendor staging; do
  ln -sfn "$TREE/$d" "$GOPATH_DIR/src/k8s.io/kubernetes/$d"
done
python3 "$HERE/peer_patch.py" "$SRC" "$PKG/main.go.new"
if [ -x "$BIN" ] && [ -f "$PKG/main.go" ] && cmp -s "$PKG/main.go" "$PKG/main.go.new"; then
  rm -f "$PKG/main.go.new"
  echo "$BIN"
  exit 0
fi
mv "$PKG/main.go.new" "$PKG/main.go"
log "building the client-go leader-election peer (about 40 s on 2 cores)"
with_heartbeat "go build (peer)" "$OUT_DIR/build-peer.log" \
  env -C "$PKG" GOPATH="$GOPATH_DIR" GO111MODULE=off CGO_ENABLED=0 GOFLAGS= \
  go build -o "$BIN.tmp" .
mv "$BIN.tmp" "$BIN"
echo "$BIN"
