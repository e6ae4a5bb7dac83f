#!/usr/bin/env bash
# The test bed's OCI registry: CNCF distribution's `registry`, plain HTTP on loopback, for the
# release tests (hack/release.sh pushes images and the chart to it; the node pulls from it).
#
#   hack/registry.sh up       build the registry once (hack/gotool.sh), start it, wait until it
#                             answers /v2/
#   hack/registry.sh down     stop it; its storage goes with it
#   hack/registry.sh status   say whether it answers
#
# Address: $FL_REGISTRY (hack/lib.sh; default 127.0.0.1:5151, FENCEDLEASE_REGISTRY overrides it).
# Storage, config and log live in $FENCEDLEASE_CLUSTER_DIR/registry (default
# /tmp/fencedlease-cluster/registry). Deletes are enabled, so tests can remove what they pushed.
# It listens on loopback only and has no authentication: a test bed, not a deployment.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

DIR="$FL_CLUSTER_DIR/registry"
PIDFILE="$DIR/registry.pid"
LOGFILE="$DIR/registry.log"

answers() { curl -fs -o /dev/null --max-time 2 "http://$FL_REGISTRY/v2/"; }

up() {
  if answers; then log "registry already answers on http://$FL_REGISTRY"; return 0; fi
  case "$FL_REGISTRY" in
    127.*:* | localhost:*) ;;
    *) die "FL_REGISTRY=$FL_REGISTRY: the test bed's registry listens on loopback only (127.x.y.z:PORT)" ;;
  esac
  local bin
  bin=$("$(dirname "$0")/gotool.sh" registry)
  mkdir -p "$DIR/storage"
  cat >"$DIR/config.yml" <<YAML
# Written by hack/registry.sh.
version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $DIR/storage
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: $FL_REGISTRY
  secret: fencedlease-test-bed-only
YAML
  log "starting the OCI registry on http://$FL_REGISTRY (log: $LOGFILE)"
  setsid "$bin" serve "$DIR/config.yml" >>"$LOGFILE" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  wait_for "the registry on $FL_REGISTRY" 30 "$LOGFILE" "$PIDFILE" "hack/registry.sh down && hack/registry.sh up" answers
}

down() {
  if [ -f "$PIDFILE" ]; then
    stop_pid registry "$(cat "$PIDFILE")"
    rm -f "$PIDFILE"
  fi
  ! answers || die "something still answers on http://$FL_REGISTRY after stopping ours: stop it (ss -ltnp | grep ${FL_REGISTRY##*:})"
  rm -rf --one-file-system "$DIR/storage"
  log "registry down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) if answers; then echo "up: http://$FL_REGISTRY"; else echo "down"; exit 1; fi ;;
  *) die "usage: $0 up|down|status" ;;
esac
