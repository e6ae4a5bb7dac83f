#!/usr/bin/env bash
# The main job: a real local Kubernetes, the CRD applied with kubectl, the controller, and two
# workers campaigning for one FencedLease. Worker A leads; it is paused (SIGSTOP) past its
# lease, as a long GC or a stalled VM would; B takes over with a larger token; A resumes and
# reports that it no longer leads. Exits non-zero if the outcome is not the expected one.
#
#   hack/demo.sh                    run it (brings up the local Kubernetes if needed)
#   FL_KEEP_CLUSTER=1 hack/demo.sh  leave the cluster running afterwards
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs), then rerun"
apt_install curl openssl iproute2 procps bc
started_cluster=0
if ! hack/cluster.sh status >/dev/null 2>&1; then
  [ "${FL_KEEP_CLUSTER:-0}" = 1 ] || started_cluster=1
  hack/cluster.sh up
fi
eval "$(hack/cluster.sh env)"
export KUBECONFIG

log "building fencedlease"
cargo build --quiet
bin="$FL_REPO/target/debug/fencedlease"
work=$(mktemp -d /tmp/fencedlease-demo.XXXXXX)
pids=()
cleanup_procs() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'cleanup_procs; [ $started_cluster = 0 ] || hack/cluster.sh down' EXIT

ns=demo
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
t0=$(date +%s%N)
stamp() { printf '+%6.2fs' "$(echo "($(date +%s%N) - $t0) / 1000000000" | bc -l)"; }

say "1. kubectl apply -f crds/"
kubectl apply -f crds/
kubectl wait --for=condition=Established --timeout=60s crd/fencedleases.fencedlease.io >/dev/null
kubectl delete namespace "$ns" --ignore-not-found --wait=true >/dev/null
kubectl create namespace "$ns" >/dev/null

say "2. the controller (keeps status, revokes expired leases, emits Events)"
RUST_LOG=info "$bin" controller --namespace "$ns" --election-namespace "$ns" --identity controller-0 \
  --metrics-addr 127.0.0.1:0 >"$work/controller.log" 2>&1 &
pids+=($!)

say "3. two workers campaign for FencedLease $ns/inventory (lease 3 s)"
worker() { # NAME: runs a command while leading that prints its token every 0.5 s
  RUST_LOG=warn "$bin" campaign --lease inventory --namespace "$ns" --identity "$1" --lease-duration 3 \
    --events-file "$work/$1.events" -- \
    sh -c 'while :; do echo "$(date +%T.%N | cut -c1-12) $FENCEDLEASE_IDENTITY works with token $FENCEDLEASE_TOKEN"; sleep 0.5; done' \
    >"$work/$1.out" 2>"$work/$1.log" &
  pids+=($!)
}
worker worker-a
sleep 2
worker worker-b
sleep 1
leader_token() { kubectl -n "$ns" get flease inventory -o jsonpath='{.spec.holderIdentity} {.metadata.generation}'; }
read -r holder1 token1 <<<"$(leader_token)"
[ "$holder1" = worker-a ] || die "expected worker-a to lead first, got '$holder1'"
kubectl -n "$ns" get flease inventory
echo "$(stamp) worker-a leads with token $token1"

say "4. worker-a is paused (SIGSTOP) for 6 s, twice its lease"
kill -STOP "${pids[1]}"
echo "$(stamp) worker-a paused"
for _ in $(seq 60); do
  read -r holder2 token2 <<<"$(leader_token)"
  [ "$holder2" = worker-b ] && break
  sleep 0.1
done
[ "$holder2" = worker-b ] || die "worker-b did not take over (holder: '$holder2')"
echo "$(stamp) worker-b leads with token $token2 (larger than $token1: $([ "$token2" -gt "$token1" ] && echo yes || echo NO))"
[ "$token2" -gt "$token1" ] || die "the token did not increase"
sleep 4
kill -CONT "${pids[1]}"
resumed_ns=$(date +%s%N)
echo "$(stamp) worker-a resumed"
sleep 1.5

say "5. what each worker believed (from their own event logs)"
cat "$work"/worker-*.events | sort | python3 -c '
import json, sys
evs = [json.loads(l) for l in sys.stdin]
t0 = min(e["t_ns"] for e in evs)
for e in sorted(evs, key=lambda e: e["t_ns"]):
    if e["event"] in ("leading", "stopped"):
        dt = (e["t_ns"] - t0) / 1e9
        print("+%6.2fs  %-9s %-8s token %s" % (dt, e["identity"], e["event"], e.get("token")))
'
resumed_first=$(python3 -c '
import json
evs=[json.loads(l) for l in open("'"$work"'/worker-a.events")]
after=[e for e in evs if e["t_ns"]>='"$resumed_ns"' and e["event"] in ("stopped","renewed","leading")]
print(after[0]["event"] if after else "none")')
[ "$resumed_first" = stopped ] || die "worker-a's first word after resuming should be 'stopped', was '$resumed_first'"

say "6. kubectl get flease, and the Events the controller emitted"
kubectl -n "$ns" get flease inventory
kubectl -n "$ns" get events --sort-by=.metadata.creationTimestamp \
  -o custom-columns=REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message
echo
echo "worker-a's command was not paused with it, and kept working with token $token1 until"
echo "worker-a resumed and stopped it; these are the stale writes that fencing must refuse:"
tail -n 2 "$work/worker-a.out"
echo "worker-b's own output ends with:"; tail -n 2 "$work/worker-b.out"
say "result: one leader at a time; the paused worker was replaced with a larger token and stepped down on resuming"
echo "(the fencing webhook, which makes the API server refuse the paused worker's stale writes, is the next step: see issue 'Fencing webhook')"
