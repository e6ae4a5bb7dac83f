#!/usr/bin/env bash
# Fencing beyond Kubernetes: the articles' story with a real PostgreSQL as the protected
# resource. Needs a running local Kubernetes (hack/cluster.sh up) and the fencedlease binary.
#   examples/postgres/demo.sh [PATH-TO-fencedlease]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=hack/lib.sh
source "$repo/hack/lib.sh"
bin=${1:-$repo/target/debug/fencedlease}
[ -x "$bin" ] || die "no fencedlease binary at $bin: run cargo build first"
command -v psql >/dev/null && [ -d /usr/lib/postgresql ] || apt_install postgresql
pgbin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
id postgres >/dev/null 2>&1 || die "no 'postgres' user: install Debian's postgresql package"
eval "$("$repo/hack/cluster.sh" env)"; export KUBECONFIG

work=$(mktemp -d /tmp/fencedlease-pg.XXXXXX)
chown postgres "$work"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PGHOST="$work" PGPORT="$port" PGUSER=postgres PGDATABASE=postgres
# Signals a worker as a whole (SIG PID [app]): every process group in its tree, or with "app"
# all but campaign's own. campaign runs its command in a session of its own, so that it can kill
# the command's whole tree.
signal_worker() {
  local sig="$1" todo=("$2") p groups="" skip=""
  [ "${3:-}" = app ] && skip=$(ps -o pgid= -p "$2" | tr -d ' ')
  while [ ${#todo[@]} -gt 0 ]; do
    p=${todo[0]}; todo=("${todo[@]:1}")
    groups+=" $(ps -o pgid= -p "$p" 2>/dev/null)"
    for c in $(pgrep -P "$p"); do todo+=("$c"); done
  done
  for g in $(echo "$groups" | tr ' ' '\n' | sort -u); do
    [ "$g" = "$skip" ] || kill "-$sig" -- "-$g" 2>/dev/null || true
  done
}
pids=()
cleanup() {
  for p in "${pids[@]}"; do signal_worker CONT "$p"; signal_worker TERM "$p"; done
  runuser -u postgres -- "$pgbin/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
  kubectl delete namespace pg-demo --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT
log "starting PostgreSQL on 127.0.0.1:$port (socket in $work)"
runuser -u postgres -- "$pgbin/initdb" -D "$work/data" -A trust -U postgres >"$work/initdb.log" 2>&1
runuser -u postgres -- "$pgbin/pg_ctl" -D "$work/data" -l "$work/postgres.log" -w \
  -o "-k $work -p $port -c listen_addresses=127.0.0.1" start >/dev/null
psql -Xq -f "$here/schema.sql"

# The CRD the server takes: crds/ from Kubernetes 1.25 (validation rules), crds/pre-1.25/ before.
"$bin" crd --for-server | kubectl apply -f - >/dev/null
kubectl create namespace pg-demo >/dev/null
kubectl -n pg-demo apply -f - >/dev/null <<'YAML'
apiVersion: fencedlease.io/v1alpha1
kind: FencedLease
metadata: {name: orders-db}
spec: {leaseDurationSeconds: 3}
YAML
uid=$(kubectl -n pg-demo get flease orders-db -o jsonpath='{.metadata.uid}')
psql -Xq -v uid="$uid" <<'SQL'
INSERT INTO inventory (item, left_in_stock, lease_uid) VALUES ('last-widget', 1, :'uid');
SQL
out="$work/timeline"
worker() { # NAME THINK
  setsid env RUST_LOG=warn "$bin" campaign --lease orders-db --namespace pg-demo --identity "$1" \
    --lease-duration 3 --grace-seconds 10 -- "$here/reserve.sh" last-widget "$1" "$2" >>"$out" 2>>"$work/$1.log" &
  pids+=($!)
}
worker worker-a 2
until grep -q "worker-a .*reads" "$out" 2>/dev/null; do sleep 0.05; done
worker worker-b 0
signal_worker STOP "${pids[0]}"
echo "$(date +%T.%N | cut -c1-12) worker-a is paused past its 3 s lease" >>"$out"
for _ in $(seq 150); do grep -q "worker-b .*reserves" "$out" && break; sleep 0.1; done
sleep 2
# The app's write was under way when the machine froze: it goes out as soon as the app runs
# again, before campaign (resumed just after) can notice the lease is gone and stop the app.
echo "$(date +%T.%N | cut -c1-12) worker-a resumes" >>"$out"
signal_worker CONT "${pids[0]}" app
for _ in $(seq 100); do grep -q "worker-a .*reserves" "$out" && break; sleep 0.1; done
signal_worker CONT "${pids[0]}"
sort "$out"
row=$(psql -XAtq -c "SELECT left_in_stock || ' left, reserved by ' || array_to_string(reserved_by, ', ') || ', highest token ' || fence_token FROM inventory")
echo "final row: $row"
grep -q "worker-a .*REFUSED" "$out" || die "worker-a's stale reservation was not refused"
case "$row" in "0 left, reserved by worker-b, highest token "*) ;; *) die "unexpected row: $row" ;; esac
log "PostgreSQL refused the stale reservation: one item, one reservation"
