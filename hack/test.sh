#!/usr/bin/env bash
# Runs every test: formatting, clippy, unit tests, and the integration tests against a real
# local kube-apiserver (started here if none is running, and stopped again afterwards).
#
#   hack/test.sh                 everything
#   hack/test.sh -- NAME         only cargo tests whose name contains NAME
#   FL_KEEP_CLUSTER=1 hack/test.sh   leave the cluster running for a look afterwards
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"

[ "${1:-}" = "--" ] && shift
command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs), then rerun"
apt_install curl openssl iproute2 procps

started_cluster=0 started_node=0
# The node goes down before the control plane, so that its Node object can be deleted.
[ "${FL_KEEP_CLUSTER:-0}" = 1 ] ||
  trap '[ $started_node = 1 ] && hack/node.sh down; [ $started_cluster = 1 ] && hack/cluster.sh down' EXIT
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
log "building the image from the debug binary (hack/image.sh)"
cargo build --quiet
FL_IMAGE_PROFILE=debug hack/image.sh

log "cargo fmt --check"
cargo fmt --all -- --check || die "formatting differs: run 'cargo fmt' and commit"
log "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
log "cargo test (integration tests use KUBECONFIG=$KUBECONFIG; component logs: $FL_CLUSTER_DIR/logs)"
if ! cargo test --all-targets -- "$@"; then
  [ $started_cluster = 1 ] && log "cluster logs for the failure: $FL_CLUSTER_DIR/logs/"
  exit 1
fi
# The history test runs on a local Kubernetes of its own (its nemesis restarts the API server
# and etcd), after the shared cluster's tests.
seed="${FL_HISTORY_SEED:-$RANDOM}"
log "history test (fault injection), seed $seed: hack/history.sh --duration 60 --seed $seed"
if ! hack/history.sh --duration "${FL_HISTORY_DURATION:-60}" --seed "$seed"; then
  die "the history test failed (seed $seed; output in /tmp/fencedlease-history/$seed); rerun it with: hack/history.sh --seed $seed"
fi
log "all tests passed"
