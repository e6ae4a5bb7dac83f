#!/usr/bin/env bash
# The history test (fault injection): fenced read-modify-write workers, a nemesis (pauses,
# kills, webhook/controller/API server/etcd restarts, clock skew, hung connections), and a
# checker of the fencing rules. Runs on a local Kubernetes of its own, since it restarts it.
#
#   hack/history.sh                 a bounded run (90 s of faults; part of hack/test.sh)
#   hack/history.sh --duration 3600 --seed 7    a long run
# Results: $FL_HISTORY_OUT (default /tmp/fencedlease-history/<seed>)/summary.json
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"
duration=90 seed=$RANDOM
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    *) die "usage: $0 [--duration SECONDS] [--seed N]" ;;
  esac
done
apt_install faketime curl openssl iproute2
# Its own cluster (override with FL_HISTORY_CLUSTER_DIR and FL_HISTORY_PORT_BASE to run two).
# Ports below Linux's ephemeral range (32768-60999), where an outgoing connection can hold them.
base="${FL_HISTORY_PORT_BASE:-20379}"
export FENCEDLEASE_CLUSTER_DIR="${FL_HISTORY_CLUSTER_DIR:-/tmp/fencedlease-history-cluster}"
export FL_ETCD_PORT=$base FL_ETCD_PEER_PORT=$((base + 1)) FL_APISERVER_PORT=$((base + 4064)) FL_KCM_PORT=$((base + 3878))
out="${FL_HISTORY_OUT:-/tmp/fencedlease-history/$seed}"
rm -rf "$out" && mkdir -p "$out"
trap 'hack/cluster.sh down' EXIT
hack/cluster.sh down
hack/cluster.sh up
log "building fencedlease"
cargo build --quiet
log "history run: ${duration} s of faults, seed $seed, output in $out"
python3 hack/history/run.py --bin "$FL_REPO/target/debug/fencedlease" \
  --kubeconfig "$FENCEDLEASE_CLUSTER_DIR/kubeconfig" --duration "$duration" --seed "$seed" --out "$out"
