#!/usr/bin/env bash
# The history test (fault injection): apps writing with fencing tokens (read-modify-write,
# blind merge patches, an app that ignores the loss of leadership, apps that stall between
# taking a token and writing), a nemesis (pauses, kills, webhook/controller/API server/etcd
# restarts, a fast clock, hung connections, a slowed API server, a network partition) and a
# checker of the fencing rules over the lease's history from the API servers' audit logs.
# Runs on a local Kubernetes of its own with two API servers on one etcd, since it restarts it.
#
#   hack/history.sh --duration S --seed N [--unfenced] [--summary FILE] [--min-stale N]
#
# --unfenced runs the same workload with the webhook out of the path, and at the end takes one
# acknowledged write out of its object: the checker must fail on both.
# Exit status 0 only when every check passed. Output: $FL_HISTORY_OUT (default
# /tmp/fencedlease-history/<seed>[-unfenced]): summary.json, the apps' ops-*.jsonl, the
# candidates' *.events, lease-points.json (the oracle), final-objects.json, process logs;
# `python3 hack/history/check.py DIR` checks a kept run again. FL_HISTORY_BIN, below.
set -euo pipefail
# It runs on hack/cluster.sh's default release (current Kubernetes); FL_K8S_VERSION=1.20.2 runs
# it on the oldest one supported (the recorded long run in RELIABILITY.md ran there).
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"
duration=90 seed=$RANDOM unfenced=() summary=() min_stale=100
usage="usage: $0 [--duration SECONDS] [--seed N] [--unfenced] [--summary FILE] [--min-stale N]"
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --unfenced) unfenced=(--unfenced --lose-a-write); shift ;;
    --summary) summary=(--summary "$(realpath -m "$2")"); shift 2 ;;
    --min-stale) min_stale=$2; shift 2 ;;
    *) die "$usage" ;;
  esac
done
[ "$(id -u)" = 0 ] || die "the history test needs root: it gives one candidate a network namespace of its own and cuts it with iptables"
apt_install faketime curl openssl iproute2 iptables
# Its own cluster (override with FL_HISTORY_CLUSTER_DIR and FL_HISTORY_PORT_BASE to run two).
# Ports below Linux's ephemeral range (32768-60999), where an outgoing connection can hold them.
base="${FL_HISTORY_PORT_BASE:-20379}"
export FENCEDLEASE_CLUSTER_DIR="${FL_HISTORY_CLUSTER_DIR:-/tmp/fencedlease-history-cluster}"
export FL_ETCD_PORT=$base FL_ETCD_PEER_PORT=$((base + 1)) FL_APISERVER_PORT=$((base + 4064)) FL_KCM_PORT=$((base + 3878))
# Two API servers on the one etcd (the second one's port next to the first's): the apps, the
# candidates and the webhook's reads are spread across them (run.py's APP_SERVER).
export FL_APISERVER2_PORT=$((base + 4065))
export FL_AUDIT_POLICY="$FL_REPO/hack/history/audit-policy.yaml"
out="${FL_HISTORY_OUT:-/tmp/fencedlease-history/$seed${unfenced:+-unfenced}}"
out=$(realpath -m "$out")
rm -rf "$out" && mkdir -p "$out"
# Clean-up, even when the run crashed: its processes (sessions of their own, each with
# FL_HISTORY_RUN=$out in its environment; never old pids, which the kernel hands out again
# within minutes here), its namespace, its cluster.
cleanup() {
  local env pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    tr '\0' '\n' 2>/dev/null <"$env" | grep -qxF "FL_HISTORY_RUN=$out" && { kill -9 "$pid" 2>/dev/null || true; }
  done
  ip netns pids "flh$base" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del "flh$base" 2>/dev/null || true
  hack/cluster.sh down
}
trap cleanup EXIT
hack/cluster.sh down
hack/cluster.sh up
# FL_HISTORY_BIN: a fencedlease binary to test instead of building one (a long run keeps its
# binary while the checkout changes).
bin="${FL_HISTORY_BIN:-}"
if [ -z "$bin" ]; then
  log "building fencedlease"
  with_build_lock cargo build --quiet
  bin="${CARGO_TARGET_DIR:-$FL_REPO/target}/debug/fencedlease"
fi
log "history run: ${duration} s of faults, seed $seed${unfenced:+, UNFENCED}, output in $out"
python3 hack/history/run.py --bin "$bin" \
  --kubeconfig "$FENCEDLEASE_CLUSTER_DIR/kubeconfig" --audit-log "$FENCEDLEASE_CLUSTER_DIR/logs/audit.log" \
  --kubeconfig-2 "$FENCEDLEASE_CLUSTER_DIR/kubeconfig-2" --audit-log-2 "$FENCEDLEASE_CLUSTER_DIR/logs/audit-2.log" \
  --cluster-dir "$FENCEDLEASE_CLUSTER_DIR" \
  --duration "$duration" --seed "$seed" --out "$out" --tag "$base" --min-stale "$min_stale" \
  "${unfenced[@]}" "${summary[@]}"
