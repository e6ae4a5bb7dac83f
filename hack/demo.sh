#!/usr/bin/env bash
# The main job, the articles' story for real: a local Kubernetes, the CRD applied with kubectl,
# the controller and the fencing webhook, and two workers (each an app beside a fencedlease
# sidecar, as in a pod) sharing an inventory with one item left. Worker A leads and starts a reservation; it is paused (SIGSTOP) past its lease, as a
# long GC or a stalled VM would; B takes over with a larger token and reserves the item; A
# resumes and writes its reservation with its old token: the API server refuses it. Then the
# same story without fencing shows the double booking it prevents. Exits non-zero if either
# outcome is not the expected one.
#
#   hack/demo.sh                    run it (brings up the local Kubernetes if needed)
#   FL_KEEP_CLUSTER=1 hack/demo.sh  leave the cluster running afterwards
set -euo pipefail
# Runs on the current release by default (FL_K8S_VERSION=1.20.2 for the oldest we support).
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs), then rerun"
apt_install curl openssl iproute2 procps bc postgresql
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
  for p in "${pids[@]}"; do
    kill -CONT -- "-$p" "$p" 2>/dev/null || true
    kill -- "-$p" "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap 'cleanup_procs; kubectl delete validatingwebhookconfiguration fencedlease-demo --ignore-not-found >/dev/null 2>&1; [ $started_cluster = 0 ] || hack/cluster.sh down' EXIT

ns=demo
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
t0=$(date +%s%N)
stamp() { printf '+%6.2fs' "$(echo "($(date +%s%N) - $t0) / 1000000000" | bc -l)"; }

# crds/ from Kubernetes 1.25 (it has CEL validation rules), crds/pre-1.25/ before:
# `fencedlease crd --for-server` prints the one the server takes.
say "1. fencedlease crd --for-server | kubectl apply -f -"
"$bin" crd --for-server | kubectl apply -f -
kubectl wait --for=condition=Established --timeout=60s crd/fencedleases.fencedlease.io >/dev/null
kubectl delete namespace "$ns" --ignore-not-found --wait=true >/dev/null
kubectl create namespace "$ns" >/dev/null

say "2. the controller and the fencing webhook"
RUST_LOG=info "$bin" controller --namespace "$ns" --election-namespace "$ns" --identity controller-0 \
  --metrics-addr 127.0.0.1:0 >"$work/controller.log" 2>&1 &
pids+=($!)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
bundle=$("$bin" certs --out "$work/certs" --host 127.0.0.1)
RUST_LOG=info "$bin" webhook --listen "127.0.0.1:$port" --tls-cert "$work/certs/tls.crt" \
  --tls-key "$work/certs/tls.key" --metrics-addr 127.0.0.1:0 >"$work/webhook.log" 2>&1 &
pids+=($!)
kubectl apply -f - >/dev/null <<YAML
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: fencedlease-demo}
webhooks:
- name: fencing.fencedlease.io
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 5
  clientConfig: {url: "https://127.0.0.1:$port/validate", caBundle: "$bundle"}
  namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: $ns}}
  objectSelector: {matchExpressions: [{key: fencedlease.io/lease, operator: Exists}]}
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [configmaps], scope: Namespaced}]
YAML
# 1.20 does not label namespaces with their name yet: do it, for the selector above.
kubectl label namespace "$ns" kubernetes.io/metadata.name="$ns" --overwrite >/dev/null
echo "controller running; webhook serving https://127.0.0.1:$port/validate for labelled ConfigMaps in $ns"

# story LEASE CONFIGMAP LABELLED: one run of the story; prints the timeline, sets $final.
story() {
  local lease=$1 cm=$2 labelled=$3 timeline="$work/$2.timeline"
  : >"$timeline"
  local labels=""
  declare -A wpid
  [ "$labelled" = yes ] && labels="labels: {fencedlease.io/lease: $lease}"
  # Create the inventory as the first holder would; its token comes from the lease.
  "$bin" campaign --lease "$lease" --namespace "$ns" --identity setup --lease-duration 3 -- sh -c "
    kubectl -n $ns apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ConfigMap
metadata:
  name: $cm
  $labels
  annotations: {fencedlease.io/token: \"\$FENCEDLEASE_TOKEN\", fencedlease.io/lease-uid: \"\$FENCEDLEASE_LEASE_UID\"}
data: {items: \"1\", reservations: \"\"}
YAML" 2>>"$work/setup.log" || die "creating the inventory failed (see $work/setup.log)"
  worker() { # NAME THINK: a "pod": the fencedlease sidecar and the app, one process group
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    setsid env RUST_LOG=warn FENCEDLEASE_IDENTITY="$1" FENCEDLEASE_NAMESPACE="$ns" \
      FENCEDLEASE_URL="http://127.0.0.1:$port" \
      FENCEDLEASE_API_SECRET_FILE="$work/$lease-$1-token/api-secret" sh -c '
        "$0" sidecar --lease "$1" --namespace "$FENCEDLEASE_NAMESPACE" --identity "$FENCEDLEASE_IDENTITY" \
          --listen "127.0.0.1:$2" --lease-duration 3 --token-dir "$3" &
        exec "$4" "$5" "$6" "$7"' \
      "$bin" "$lease" "$port" "$work/$lease-$1-token" "$FL_REPO/hack/demo-worker.sh" "$cm" "$timeline" "$2" \
      2>>"$work/$lease-$1.log" &
    pids+=($!)
    wpid[$1]=$!
  }
  worker worker-a 2
  until grep -q "worker-a .*reads" "$timeline" 2>/dev/null; do sleep 0.05; done
  worker worker-b 0
  kill -STOP -- "-${wpid[worker-a]}"
  echo "$(date +%s%N) worker-a is paused (SIGSTOP of its process group) past its 3 s lease" >>"$timeline"
  for _ in $(seq 150); do grep -q "worker-b .*writes" "$timeline" && break; sleep 0.1; done
  sleep 3
  echo "$(date +%s%N) worker-a resumes" >>"$timeline"
  kill -CONT -- "-${wpid[worker-a]}"
  for _ in $(seq 100); do grep -q "worker-a .*writes" "$timeline" && break; sleep 0.1; done
  sleep 0.5
  python3 - "$timeline" <<'PY'
import sys
lines = [l.rstrip("\n").split(" ", 1) for l in open(sys.argv[1]) if l.strip()]
t0 = min(int(t) for t, _ in lines)
for t, what in sorted(lines, key=lambda x: int(x[0])):
    print("  +%5.2fs  %s" % ((int(t) - t0) / 1e9, what))
PY
  final=$(kubectl -n "$ns" get configmap "$cm" -o jsonpath='items={.data.items} reservations=[{.data.reservations}]')
  echo "  final inventory: $final"
  kill -- "-${wpid[worker-a]}" "-${wpid[worker-b]}" 2>/dev/null || true
}

say "3. with fencing: the inventory ConfigMap is labelled fencedlease.io/lease=inventory"
echo "  (each worker is an app beside a fencedlease sidecar, which hands it the token over HTTP)"
story inventory inventory yes
fenced=$final
grep -q "worker-a .*REFUSED.*stale token" "$work/inventory.timeline" || die "worker-a's stale write was not refused"
[ "$fenced" = "items=0 reservations=[worker-b]" ] || die "unexpected inventory with fencing: $fenced"

say "4. the same story without fencing (no label: the webhook is not asked)"
story unfenced inventory-unfenced no
unfenced=$final
[ "$(grep -c "writes its reservation: ACCEPTED" "$work/inventory-unfenced.timeline")" = 2 ] ||
  die "without fencing, both writes should have been accepted"
[ "$unfenced" = "items=0 reservations=[worker-a]" ] || die "expected worker-a's stale write to overwrite worker-b's, got: $unfenced"

say "5. the lease and the Events the controller emitted"
kubectl -n "$ns" get flease
kubectl -n "$ns" get events --sort-by=.metadata.creationTimestamp \
  -o custom-columns=REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message | grep -v setup || true

say "6. beyond Kubernetes: the same story with PostgreSQL as the protected resource"
"$FL_REPO/examples/postgres/demo.sh" "$bin" 2>&1 | grep -v '^Warning: resource customresourcedefinitions' ||
  die "the PostgreSQL story did not end as expected"

say "result"
echo "with fencing:    $fenced   (worker-a's late write was refused: one reservation)"
echo "without fencing: $unfenced   (both were told ACCEPTED for the one item; worker-a's stale"
echo "                 write silently overwrote worker-b's reservation)"
echo "PostgreSQL:      a conditional UPDATE on the highest token refused worker-a's stale blind write"
