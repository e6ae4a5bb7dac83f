#!/usr/bin/env bash
# Builds the benchmarks' kube-apiserver: Kubernetes v1.20.2 from the same source tree as the
# tests' one (hack/k8s-binaries.sh), with ONE change made at build time through `go build
# -overlay` (bench/apiserver_patch.py; the tree itself is not edited):
#   the bucket boundaries of the admission latency histograms
#   (apiserver_admission_webhook_admission_duration_seconds and its step/controller siblings)
#   become 20 us x 1.15^k (85 of them, 20 us to 2.5 s) instead of 5 ms, 25 ms, 100 ms, 0.5 s, 2.5 s.
# With 1.20's five buckets the API server's own timing of a webhook call says only "under 5 ms";
# with these, its p50/p99 can be read as bucket upper bounds at most 15 % above the true value,
# which the webhook-apiserver benchmark reports as the API server's own timing of each webhook
# call. Nothing else differs.
#
# Output: a folder in the setup-envtest layout (etcd, kube-apiserver, kube-controller-manager)
# that bench/run.sh hands to hack/cluster.sh as KUBEBUILDER_ASSETS. Prints its path.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/lib.sh
source "$HERE/../hack/lib.sh"
# The benchmarks build from Kubernetes v1.20.2's source tree (Debian's package), which only the
# legacy build unpacks, and their recorded results are on that release: pin it (exported, so
# that hack/k8s-binaries.sh builds the same one).
FL_K8S_VERSION="$FL_K8S_LEGACY_VERSION"
export FL_K8S_VERSION

STD_BIN="$("$HERE/../hack/k8s-binaries.sh")" # builds the tree and the standard binaries first
TREE="$FL_CACHE/k8s-$FL_K8S_VERSION/src/kubernetes"
OUT_DIR="$FL_CACHE/k8s-$FL_K8S_VERSION/bench-bin"
REL="staging/src/k8s.io/apiserver/pkg/admission/metrics/metrics.go"
SRC="$TREE/$REL"
[ -f "$SRC" ] || die "the Kubernetes v$FL_K8S_VERSION source tree is missing ($TREE): hack/k8s-binaries.sh unpacks it when it builds the control plane, which it skips when KUBEBUILDER_ASSETS is set or $STD_BIN is complete; unset KUBEBUILDER_ASSETS or move that bin folder away and run again"

# Kubernetes' build resolves its own folder (pwd -P) and makes its GOPATH under it: the overlay
# must name the file by that real path, whatever symlinks the cache folder goes through.
TREE="$(cd "$TREE" && pwd -P)"
WORK="$OUT_DIR/overlay"
SUB=_output/fencedlease-bench # the build's output (and GOPATH and GOCACHE) inside the tree
mkdir -p "$WORK"
MARK='fencedlease bench build: buckets 20us x 1.15^k'
python3 "$HERE/apiserver_patch.py" "$SRC" "$WORK/metrics.go.new" "$MARK"
# Kubernetes' build makes its own GOPATH (and GOCACHE) in the output folder, linking
# k8s.io/kubernetes to the tree; the go command sees the file there, through vendor -> staging.
printf '{"Replace": {"%s": "%s"}}\n' \
  "$TREE/$SUB/go/src/k8s.io/kubernetes/vendor/k8s.io/apiserver/pkg/admission/metrics/metrics.go" \
  "$WORK/metrics.go" >"$WORK/overlay.json.new"
use_go_for_k8s_1_20
# What the cached binary was built from, besides those two files: the compiler and the tree.
{ go version; ls -l --time-style=+%s "$TREE"/../*.dsc 2>/dev/null || true; } >"$WORK/stamp.new"
same() { [ -f "$WORK/$1" ] && cmp -s "$WORK/$1" "$WORK/$1.new"; }
if [ -x "$OUT_DIR/kube-apiserver" ] && same metrics.go && same overlay.json && same stamp; then
  rm -f "$WORK/metrics.go.new" "$WORK/overlay.json.new" "$WORK/stamp.new"
else
  mv "$WORK/metrics.go.new" "$WORK/metrics.go"
  mv "$WORK/overlay.json.new" "$WORK/overlay.json"
  mv "$WORK/stamp.new" "$WORK/stamp"
  rm -f "$OUT_DIR/kube-apiserver" # not kept if this build fails
  log "building the benchmarks' kube-apiserver (finer admission latency buckets; a few minutes on 2 cores, cached afterwards)"
  (
    cd "$TREE/.go/src/k8s.io/kubernetes"
    export GOPATH="$TREE/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS="-overlay=$WORK/overlay.json"
    # Its own output folder, so that the standard build's binaries are not replaced.
    with_heartbeat "go build cmd/kube-apiserver (bench buckets)" "$OUT_DIR/build.log" \
      make WHAT=cmd/kube-apiserver KUBE_OUTPUT_SUBPATH="$SUB"
  )
  grep -qaF "$MARK" "$TREE/$SUB/bin/linux/amd64/kube-apiserver" ||
    die "the kube-apiserver just built does not carry the bench patch (the overlay did not apply; see $WORK/overlay.json and $OUT_DIR/build.log)"
  install -m 0755 "$TREE/$SUB/bin/linux/amd64/kube-apiserver" "$OUT_DIR/kube-apiserver"
  log "benchmarks' kube-apiserver ready: $OUT_DIR/kube-apiserver"
fi
ln -sfn "$STD_BIN/etcd" "$OUT_DIR/etcd"
ln -sfn "$STD_BIN/kube-controller-manager" "$OUT_DIR/kube-controller-manager"
echo "$OUT_DIR"
