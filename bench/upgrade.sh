#!/usr/bin/env bash
# The upgrade's write availability (issue 36), measured: runs tests/release.rs's upgrade and
# downgrade test N times on the real node and keeps every write's outcome.
#
#   bench/upgrade.sh [--runs N]        (default 5; needs hack/cluster.sh, hack/node.sh and
#                                       hack/registry.sh up, as hack/test.sh leaves them with
#                                       FL_KEEP_CLUSTER=1)
#
# Each run installs the previous release from the test bed's registry, upgrades to this tree's
# release and downgrades back while a holder and a replaced holder each write every 100 ms.
# Output: bench/results/upgrade-<time>/run-K.json (every write: when, and the refusal if any;
# the marks of each step) and summary.md (bench/upgrade_summary.py): per run, the holder's
# writes, how many were refused and the longest refused stretch, and the stale writes accepted.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../hack/lib.sh"
runs=5
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="${2:?--runs needs a number}"; shift 2 ;;
    *) die "usage: $0 [--runs N]" ;;
  esac
done
cd "$FL_REPO"
out="bench/results/upgrade-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
export KUBECONFIG="${KUBECONFIG:-$FL_CLUSTER_DIR/kubeconfig}"
for k in $(seq "$runs"); do
  log "upgrade run $k of $runs (output: $out/run-$k.json)"
  FL_UPGRADE_SAMPLES="$PWD/$out/run-$k.json" cargo test --quiet --test release -- --exact \
    upgrade_and_downgrade_under_a_stale_writer_accept_no_stale_write >"$out/run-$k.log" 2>&1 ||
    die "run $k failed (log: $out/run-$k.log)"
done
{
  echo "# Upgrade and downgrade under a stale writer: $runs runs, $(git rev-parse --short HEAD), $(date -u +%FT%TZ)"
  echo
  python3 bench/upgrade_summary.py "$out"/run-*.json
} >"$out/summary.md"
cat "$out/summary.md"
