#!/usr/bin/env bash
# Runs every test: formatting, clippy, unit tests, and the integration tests against a real
# local kube-apiserver (started here if none is running, and stopped again afterwards).
#
#   hack/test.sh                 everything
#   hack/test.sh -- NAME         only cargo tests whose name contains NAME (no history test)
#   FL_KEEP_CLUSTER=1 hack/test.sh   leave the cluster running for a look afterwards
set -euo pipefail
# The whole suite, node included, runs on the current release ($FL_K8S_DEFAULT_VERSION, or
# FL_K8S_VERSION); then a compatibility subset on the oldest supported one (1.20.2).
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
export FL_K8S_VERSION
cd "$FL_REPO"

[ "${1:-}" = "--" ] && shift
command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs), then rerun"
apt_install curl openssl iproute2 procps
# .ci/run from a fresh clone on a fresh machine (2026-12-02) grew the disk's use by about 16.7
# GiB: Kubernetes' builds, both releases, with Go's caches 7.9 GiB; cargo's target folder 7.3
# GiB, of which 3.1 GiB incremental caches (which .ci/run now turns off); the rest crates, Go
# 1.19, clusters, images, logs.
k8s_cold=0
for v in "$FL_K8S_DEFAULT_VERSION" "$FL_K8S_LEGACY_VERSION"; do
  [ -x "$FL_CACHE/k8s-$v/bin/kube-apiserver" ] || k8s_cold=8
done
need_disk $((8 + k8s_cold)) "the test suite$([ $k8s_cold = 0 ] || echo ", building Kubernetes first,")" \
  "${CARGO_TARGET_DIR:-$FL_REPO/target}"

started_cluster=0 started_node=0 started_registry=0
# The node goes down before the control plane, so that its Node object can be deleted.
[ "${FL_KEEP_CLUSTER:-0}" = 1 ] ||
  trap '[ $started_registry = 1 ] && hack/registry.sh down; [ $started_node = 1 ] && hack/node.sh down; [ $started_cluster = 1 ] && hack/cluster.sh down' EXIT
if ! hack/cluster.sh status >/dev/null 2>&1; then
  started_cluster=1
  hack/cluster.sh up
fi
eval "$(hack/cluster.sh env)"
export KUBECONFIG
# A real node (kubelet + containerd) and the project's image, for the tests that run pods.
if ! hack/node.sh status >/dev/null 2>&1; then
  started_node=1
  hack/node.sh up
fi
# The release tools (registry, cosign, crane, krew's validator, actionlint: built once from their
# Go modules) and the test bed's OCI registry, for tests/release.rs.
log "release tools (hack/gotool.sh all; cold: about four minutes) and the OCI registry"
hack/gotool.sh all
if ! hack/registry.sh status >/dev/null 2>&1; then
  started_registry=1
  hack/registry.sh up
fi
log "building the image from the debug binary (hack/image.sh)"
cargo build --quiet
FL_IMAGE_PROFILE=debug hack/image.sh
# The chart injects the sidecar's image (injection.sidecar.image): the sidecar's build, unoptimized.
log "building the sidecar's image from its debug build (FL_IMAGE_ROLE=sidecar hack/image.sh)"
FL_IMAGE_PROFILE=debug FL_IMAGE_ROLE=sidecar hack/image.sh

log "release files: the workflow (actionlint), the krew manifest (validate-krew-manifest), the chart's Artifact Hub metadata"
hack/lint-release.sh
log "cargo fmt --check"
cargo fmt --all -- --check || die "formatting differs: run 'cargo fmt' and commit"
log "the book (docs/): hack/book.sh"
hack/book.sh
# The workspace: the root package and the elector library (elector/).
log "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The sidecar's build (Cargo.toml: without the `operator` feature): its library and binary.
log "cargo clippy --no-default-features --lib --bins -- -D warnings (the sidecar's build)"
cargo clippy --no-default-features --lib --bins --quiet -- -D warnings
log "Python client unit tests (clients/python; tests/client_python.rs runs it against real sidecars)"
PYTHONPATH=clients/python/src python3 -m unittest discover -s clients/python/tests -t clients/python
command -v go >/dev/null || die "go not found: the Go client (clients/go) needs Go 1.24 or later on PATH (https://go.dev/dl)"
log "Go client unit tests (clients/go; tests/client_go.rs runs its integration test against real sidecars)"
(cd clients/go && go vet ./... && go test -count=1 ./...)
# The in-process FencedLease lock and fenced client for client-go and controller-runtime
# (clients/go/kube), and the controller-runtime sample (examples/controller-runtime): modules of
# their own (client-go and controller-runtime come from the Go module proxy into Go's caches on
# the first run). tests/adoption_controller_runtime.rs runs them against the real webhook.
log "Go: clients/go/kube (unit tests) and examples/controller-runtime (vet)"
(cd clients/go/kube && go vet ./... && go test -count=1 ./...)
(cd examples/controller-runtime && go vet ./...)
# Each integration test keeps its processes' logs in a scratch folder (tests/common/procs.rs) for
# a failure's reading; the earlier runs' folders are of no more use.
tmp="${TMPDIR:-/tmp}"
removed=$(find "$tmp" -maxdepth 1 -name 'fencedlease-test-*' -print -exec rm -rf {} + | wc -l)
log "removed $removed earlier runs' test scratch folders from $tmp"
# The sample operators the tests run as programs: `cargo test --all-targets` builds examples
# as test harnesses, not as the programs tests/adoption_kube_runtime.rs starts.
log "cargo build -p fencedlease-elector --examples (the kube-runtime sample operator)"
cargo build -p fencedlease-elector --examples --quiet
log "cargo test (integration tests use KUBECONFIG=$KUBECONFIG; component logs: $FL_CLUSTER_DIR/logs; each test's own in $tmp/fencedlease-test-*)"
if ! cargo test --workspace --all-targets --no-fail-fast -- "$@"; then
  [ $started_cluster = 1 ] && log "cluster logs for the failure: $FL_CLUSTER_DIR/logs/"
  exit 1
fi
# --all-targets leaves out doc tests: the elector crate's documented examples must compile.
log "elector crate doc tests"
cargo test -p fencedlease-elector --doc -- "$@"
# The crate as crates.io would take it (issue 35): its documentation without a warning, and a
# dry-run publish (packs it and builds the package alone, from the registry's dependencies).
# Alone, k8s-openapi needs a Kubernetes version chosen (a library leaves it to the program).
log "elector crate: cargo doc (warnings denied) and cargo publish --dry-run"
K8S_OPENAPI_ENABLED_VERSION=1.33 RUSTDOCFLAGS="-D warnings" cargo doc -p fencedlease-elector --no-deps --quiet
K8S_OPENAPI_ENABLED_VERSION=1.33 cargo publish --dry-run -p fencedlease-elector --quiet
# The compatibility subset on the oldest release we support, on a second local Kubernetes of
# its own: the CRD, election, the controller, the fencing webhook, injection with the sidecar
# as an ordinary container (no native sidecars before 1.29), the chart. (No node: the pods'
# lifecycle is the current kubelet's.)
old_k8s="$FL_K8S_LEGACY_VERSION"
compat_tests=()
for n in crd_api election controller webhook fencing_presented fencing_exempt fencing_subresources \
  fencing_server_side_apply injection_patch sidecar lease_rights chart crd_rules webhook_match_conditions \
  elector_crate; do
  [ -f "tests/$n.rs" ] || die "hack/test.sh names a compatibility test tests/$n.rs that does not exist"
  compat_tests+=(--test "$n")
done
log "compatibility subset on Kubernetes $old_k8s: ${compat_tests[*]}"
if ! (
  export FL_K8S_VERSION=$old_k8s FENCEDLEASE_CLUSTER_DIR=/tmp/fencedlease-cluster-compat \
    FL_ETCD_PORT=13379 FL_ETCD_PEER_PORT=13380 FL_APISERVER_PORT=17443 FL_KCM_PORT=17257
  trap 'hack/cluster.sh down' EXIT
  hack/cluster.sh up
  KUBECONFIG="$FENCEDLEASE_CLUSTER_DIR/kubeconfig" cargo test "${compat_tests[@]}" -- "$@"
); then
  die "the compatibility tests failed on Kubernetes $old_k8s (component logs: /tmp/fencedlease-cluster-compat/logs)"
fi
# The history test runs on a local Kubernetes of its own (its nemesis restarts the API server
# and etcd), after the shared cluster's tests: first its checker's tables, then a fenced run
# that must pass with at least 100 stale writes attempted, then the same run unfenced, which
# must fail on stale writes accepted and on the acknowledged write it loses on purpose (a
# checker that cannot fail proves nothing).
if [ $# -gt 0 ]; then
  log "all tests named '$*' passed; the history test was not run (it runs when no name is given)"
  exit 0
fi
log "history checker tables"
python3 -m unittest discover -s hack/history -p 'test_*.py'
log "benchmark report tables (bench/test_*.py)"
python3 -m unittest discover -s bench -p 'test_*.py'
seed="${FL_HISTORY_SEED:-$RANDOM}"
hist_s="${FL_HISTORY_DURATION:-60}"
hist_k8s="${FL_HISTORY_K8S_VERSION:-$FL_K8S_DEFAULT_VERSION}"
log "history test (fault injection) on Kubernetes $hist_k8s, seed $seed: hack/history.sh --duration $hist_s --seed $seed"
if ! FL_K8S_VERSION=$hist_k8s hack/history.sh --duration "$hist_s" --seed "$seed"; then
  die "the history test failed (seed $seed; output in /tmp/fencedlease-history/$seed); rerun it with: hack/history.sh --seed $seed"
fi
log "history test with fencing off (must fail): hack/history.sh --duration $hist_s --seed $seed --unfenced"
unfenced_summary=/tmp/fencedlease-history/unfenced-summary.json
rm -f "$unfenced_summary"
if FL_K8S_VERSION=$hist_k8s hack/history.sh --duration "$hist_s" --seed "$seed" --unfenced --summary "$unfenced_summary"; then
  die "the unfenced history run passed its checks: the checker cannot see stale writes (output in /tmp/fencedlease-history/$seed-unfenced)"
fi
python3 - "$unfenced_summary" <<'PY' || die "the unfenced history run failed, but not on both stale writes accepted and the write lost on purpose (see /tmp/fencedlease-history/$seed-unfenced)"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["stale_accepted"] > 0 and s["checks"]["no stale write accepted"].startswith("FAIL"), s["checks"]
lost = s["checks"]["no acknowledged write lost"]
assert s["acknowledged_lost"] >= 1 and lost.startswith("FAIL") and s["lost_on_purpose"] in lost, (s["lost_on_purpose"], lost)
print(f"history: unfenced, the checker failed as it must: {s['stale_accepted']} stale writes accepted, "
      f"{s['acknowledged_lost']} acknowledged write lost on purpose")
PY
log "all tests passed"
