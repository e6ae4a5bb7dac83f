#!/usr/bin/env bash
# A real local Kubernetes control plane on loopback: etcd, kube-apiserver and
# kube-controller-manager (namespaces, garbage collection, ServiceAccount tokens). Pods are
# stored, not run, unless hack/node.sh adds a node. The API server reaches Services (webhooks)
# by dialing their endpoints (--enable-aggregator-routing), since there is no kube-proxy.
#
#   hack/cluster.sh up        start it (idempotent: a healthy cluster is kept; a broken or
#                             crashed one is cleaned up and started afresh)
#   hack/cluster.sh down      stop every process and free the ports (logs are kept)
#   hack/cluster.sh status    say whether it answers
#   hack/cluster.sh env       print `export KUBECONFIG=...` for eval
#   hack/cluster.sh restart COMPONENT [hard]   restart etcd, kube-apiserver, kube-apiserver-2 or
#                             kube-controller-manager with its data (a crash and recovery)
#
# Everything lives in $FENCEDLEASE_CLUSTER_DIR (default /tmp/fencedlease-cluster):
#   kubeconfig, pki/, logs/{etcd,kube-apiserver,kube-controller-manager}.log, pids/.
# Ports (override with the variables): etcd $FL_ETCD_PORT (12379) and $FL_ETCD_PEER_PORT
# (12380), kube-apiserver $FL_APISERVER_PORT (16443), controller-manager $FL_KCM_PORT (16257).
# A second API server: with $FL_APISERVER2_PORT set, kube-apiserver-2 runs on that port beside the
# first, on the same etcd with the same flags and pki (its own log, pid file and audit log
# logs/audit-2.log, its kubeconfig $FENCEDLEASE_CLUSTER_DIR/kubeconfig-2); unset, there is one.
# Version: FL_K8S_VERSION (default: hack/lib.sh's FL_K8S_DEFAULT_VERSION, the newest release we
# build; 1.20.2 is the oldest we support), built by hack/k8s-binaries.sh; with KUBEBUILDER_ASSETS,
# whatever version those binaries are. The flags follow the version the kube-apiserver binary
# reports, not the variable, so that brought-in binaries get the right ones. `up` on a healthy
# cluster of other binaries (another version asked for) stops it and starts the asked one.
# Auditing: with FL_AUDIT_POLICY set to an audit policy file, the API server writes its audit
# log (JSON lines, blocking mode: an event is written before the response is sent) to
# $FENCEDLEASE_CLUSTER_DIR/logs/audit.log; the history test takes the lease's history from it.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

DIR="$FL_CLUSTER_DIR"
ETCD_PORT="${FL_ETCD_PORT:-12379}"
ETCD_PEER_PORT="${FL_ETCD_PEER_PORT:-12380}"
API_PORT="${FL_APISERVER_PORT:-16443}"
KCM_PORT="${FL_KCM_PORT:-16257}"
API2_PORT="${FL_APISERVER2_PORT:-}"
KUBECONFIG_PATH="$DIR/kubeconfig"
RETRY="hack/cluster.sh down && hack/cluster.sh up"   # what to try when a start fails
# In stopping order; `down` stops those with a pid file (kube-apiserver-2 only when it ran).
COMPONENTS=(kube-controller-manager kube-apiserver-2 kube-apiserver etcd)

# healthy: every API server this cluster has (the second one when FL_APISERVER2_PORT is set)
# answers readyz.
healthy() {
  [ -f "$KUBECONFIG_PATH" ] && [ -f "$DIR/pki/admin.token" ] || return 1
  healthy_probe "$API_PORT" >/dev/null 2>&1 || return 1
  [ -z "$API2_PORT" ] || healthy_probe "$API2_PORT" >/dev/null 2>&1
}

down() {
  local any=0
  for c in "${COMPONENTS[@]}"; do
    if [ -f "$DIR/pids/$c" ]; then
      stop_pid "$c" "$(cat "$DIR/pids/$c")"
      rm -f "$DIR/pids/$c"
      any=1
    fi
  done
  # Strays from a crashed run: every component has $DIR in its command line.
  local strays
  strays=$(pgrep -f -- "$DIR/" || true)
  for pid in $strays; do
    [ "$pid" = $$ ] && continue
    ps -o args= -p "$pid" 2>/dev/null | grep -qE '(^|/)(etcd|kube-apiserver|kube-controller-manager) ' || continue
    stop_pid "stray process" "$pid"
    any=1
  done
  [ $any = 1 ] && log "local Kubernetes stopped (logs kept in $DIR/logs)"
  return 0
}

port_free() { ! ss -ltnH "sport = :$1" 2>/dev/null | grep -q .; }

start() { # NAME CMD... : run in its own session, output to logs/NAME.log
  local name="$1"; shift
  mkdir -p "$DIR/cmd"
  printf '%q ' "$@" >"$DIR/cmd/$name"   # for `restart NAME`
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$name"
}

# restart NAME [hard]: stop one component (SIGTERM, or SIGKILL with "hard") and start it again
# with the same command line and data, as a crash and recovery would.
restart() {
  local name="$1" how="${2:-}"
  [ -f "$DIR/cmd/$name" ] || die "no recorded command for $name: is the cluster up?"
  if [ -f "$DIR/pids/$name" ]; then
    local pid; pid=$(cat "$DIR/pids/$name")
    if [ "$how" = hard ]; then kill -KILL "$pid" 2>/dev/null || true; else stop_pid "$name" "$pid"; fi
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  fi
  log "restarting $name"
  eval "start $name $(cat "$DIR/cmd/$name")"
}

pki() {
  local p="$DIR/pki"
  mkdir -p "$p"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=fencedlease-local-ca" \
    -keyout "$p/ca.key" -out "$p/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$p/apiserver.key" -out "$p/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' >"$p/apiserver.ext"
  openssl x509 -req -in "$p/apiserver.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
    -days 3650 -extfile "$p/apiserver.ext" -out "$p/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
  openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
  head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$p/admin.token"
  # TOKEN,USER,UID,GROUPS. The admin is cluster-admin; other lines are test identities.
  {
    echo "$(cat "$p/admin.token"),admin,uid-admin,\"system:masters\""
  } >"$p/tokens.csv"
}

kubeconfig() { # [PATH PORT]: the admin's kubeconfig for the API server on PORT
  local path="${1:-$KUBECONFIG_PATH}" port="${2:-$API_PORT}"
  cat >"$path" <<KC
apiVersion: v1
kind: Config
clusters:
- name: fencedlease-local
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority-data: $(base64 -w0 <"$DIR/pki/ca.crt")
users:
- name: admin
  user:
    token: $(cat "$DIR/pki/admin.token")
contexts:
- name: fencedlease-local
  context: {cluster: fencedlease-local, user: admin, namespace: default}
current-context: fencedlease-local
KC
  chmod 600 "$path"
}

up() {
  command -v curl >/dev/null && command -v openssl >/dev/null && command -v ss >/dev/null ||
    apt_install curl openssl iproute2
  local bins minor
  bins=$("$FL_REPO/hack/k8s-binaries.sh")
  if healthy; then
    # A cluster started before bin-dir was recorded is kept as it is: we cannot tell.
    local running
    running=$(cat "$DIR/bin-dir" 2>/dev/null || echo "$bins")
    if [ "$running" = "$bins" ]; then
      log "local Kubernetes already running: export KUBECONFIG=$KUBECONFIG_PATH"
      return 0
    fi
    log "the running cluster uses $running, not $bins (FL_K8S_VERSION=$FL_K8S_VERSION): restarting it with those"
  fi
  down
  minor=$(binary_minor "$bins/kube-apiserver")
  for port in "$ETCD_PORT" "$ETCD_PEER_PORT" "$API_PORT" "$KCM_PORT" $API2_PORT; do
    port_free "$port" || die "port $port on 127.0.0.1 is taken by another program (see: ss -ltnp 'sport = :$port'); stop it or set FL_*_PORT"
  done
  rm -rf "$DIR/etcd" "$DIR/pki" "$DIR/pids" "$DIR/cmd"
  rm -f "$DIR"/logs/*.log "$DIR/kubeconfig-2"
  mkdir -p "$DIR/logs" "$DIR/pids" "$DIR/etcd"
  chmod 700 "$DIR/etcd"
  echo "$bins" >"$DIR/bin-dir"
  pki
  log "starting etcd on 127.0.0.1:$ETCD_PORT"
  start etcd "$bins/etcd" --name=fencedlease --data-dir="$DIR/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="fencedlease=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls="" \
    --unsafe-no-fsync=false --quota-backend-bytes=4294967296
  wait_for etcd 60 "$DIR/logs/etcd.log" "$DIR/pids/etcd" "$RETRY" curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health"

  # audit_flags LOG: the audit flags (none without FL_AUDIT_POLICY), each API server its own log.
  if [ -n "${FL_AUDIT_POLICY:-}" ] && [ ! -f "$FL_AUDIT_POLICY" ]; then
    die "FL_AUDIT_POLICY=$FL_AUDIT_POLICY: no such file"
  fi
  audit_flags() {
    [ -n "${FL_AUDIT_POLICY:-}" ] || return 0
    printf '%s\n' --audit-policy-file="$FL_AUDIT_POLICY" --audit-log-path="$DIR/logs/$1" \
      --audit-log-mode=blocking --audit-log-format=json --audit-log-maxsize=100000
  }
  local audit=() audit2=()
  mapfile -t audit < <(audit_flags audit.log)
  mapfile -t audit2 < <(audit_flags audit-2.log)
  # Flags that exist only in some versions. The insecure ports (--insecure-port on
  # kube-apiserver, --port on kube-controller-manager) were gone by 1.24; in 1.20 they default
  # to open HTTP ports (8080, 10252) that would collide between clusters, so 0 turns them off.
  # Checked on the two versions built here (1.20.2 and 1.37.2), not on those in between.
  local api_version_flags=() kcm_version_flags=()
  if [ "$minor" -lt 24 ]; then
    api_version_flags+=(--insecure-port=0)
    kcm_version_flags+=(--port=0)
  else
    # v1.37.2 refuses to start with a loopback --advertise-address while its endpoint reconciler
    # would publish it as the `kubernetes` Service's endpoint ("may not be in the loopback
    # range"), and this machine has no other address. Nothing here needs that endpoint (there is
    # no kube-proxy; hack/node.sh sends the Service IP to the API server by NAT), so publish none.
    api_version_flags+=(--endpoint-reconciler-type=none)
  fi
  # ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) is GA and on by default from
  # 1.30; nothing to enable. Older servers simply lack it.
  # The flags every API server of this cluster shares: all but its port and audit log.
  local api_flags=(--etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 "${api_version_flags[@]}" \
    --cert-dir="$DIR/pki" --tls-cert-file="$DIR/pki/apiserver.crt" --tls-private-key-file="$DIR/pki/apiserver.key" \
    --client-ca-file="$DIR/pki/ca.crt" \
    --service-cluster-ip-range=10.0.0.0/24 --authorization-mode=RBAC \
    --token-auth-file="$DIR/pki/tokens.csv" \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$DIR/pki/sa.pub" --service-account-signing-key-file="$DIR/pki/sa.key" \
    --enable-aggregator-routing=true --allow-privileged=true)
  log "starting kube-apiserver v1.$minor on 127.0.0.1:$API_PORT"
  start kube-apiserver "$bins/kube-apiserver" --secure-port="$API_PORT" "${api_flags[@]}" "${audit[@]}"
  wait_for kube-apiserver 120 "$DIR/logs/kube-apiserver.log" "$DIR/pids/kube-apiserver" "$RETRY" healthy_probe "$API_PORT"
  kubeconfig
  if [ -n "$API2_PORT" ]; then
    # After the first is ready, so that the two do not race to bootstrap the same objects.
    log "starting kube-apiserver-2 v1.$minor on 127.0.0.1:$API2_PORT (same etcd)"
    start kube-apiserver-2 "$bins/kube-apiserver" --secure-port="$API2_PORT" "${api_flags[@]}" "${audit2[@]}"
    wait_for kube-apiserver-2 120 "$DIR/logs/kube-apiserver-2.log" "$DIR/pids/kube-apiserver-2" "$RETRY" healthy_probe "$API2_PORT"
    kubeconfig "$DIR/kubeconfig-2" "$API2_PORT"
  fi

  # Each controller acts as its own ServiceAccount in kube-system (as kubeadm sets it up), so
  # the fencing webhook's exemptions for Kubernetes' own writers are tested as users meet them.
  log "starting kube-controller-manager"
  start kube-controller-manager "$bins/kube-controller-manager" \
    --kubeconfig="$KUBECONFIG_PATH" --authentication-kubeconfig="$KUBECONFIG_PATH" \
    --authorization-kubeconfig="$KUBECONFIG_PATH" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" "${kcm_version_flags[@]}" --leader-elect=false \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$DIR/pki/sa.key" --root-ca-file="$DIR/pki/ca.crt" \
    --cert-dir="$DIR/pki/kcm"
  wait_for kube-controller-manager 60 "$DIR/logs/kube-controller-manager.log" "$DIR/pids/kube-controller-manager" "$RETRY" \
    curl -fsSk --max-time 2 "https://127.0.0.1:$KCM_PORT/healthz"
  log "local Kubernetes $("$bins/kube-apiserver" --version | cut -d' ' -f2) is up: export KUBECONFIG=$KUBECONFIG_PATH (logs: $DIR/logs)"
}

healthy_probe() { # PORT
  curl -fsS --max-time 2 --cacert "$DIR/pki/ca.crt" \
    -H "Authorization: Bearer $(cat "$DIR/pki/admin.token")" "https://127.0.0.1:$1/readyz"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status)
    if healthy; then echo "running${API2_PORT:+ (two API servers: $API_PORT and $API2_PORT)}: export KUBECONFIG=$KUBECONFIG_PATH"; else echo "not running (start: hack/cluster.sh up)"; exit 1; fi ;;
  env) echo "export KUBECONFIG=$KUBECONFIG_PATH" ;;
  restart)
    case "${2:-}" in
      etcd|kube-apiserver|kube-apiserver-2|kube-controller-manager) restart "$2" "${3:-}" ;;
      *) echo "usage: $0 restart etcd|kube-apiserver|kube-apiserver-2|kube-controller-manager [hard]" >&2; exit 2 ;;
    esac ;;
  *) echo "usage: $0 up|down|status|env|restart COMPONENT [hard]" >&2; exit 2 ;;
esac
