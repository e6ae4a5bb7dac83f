#!/bin/sh
# A demo worker app beside a `fencedlease sidecar` (or run by `fencedlease campaign`): once it
# leads, it reserves the last item of an inventory ConfigMap with a blind read-modify-write,
# sending its fencing token along.
#   demo-worker.sh CONFIGMAP TIMELINE THINK_SECONDS
cm=$1 timeline=$2 think=$3
# Beside a sidecar (FENCEDLEASE_URL set): wait until this pod leads, and take the token from
# the sidecar's API. Under `fencedlease campaign`, the token is in the environment already.
if [ -z "${FENCEDLEASE_TOKEN:-}" ]; then
  # The sidecar's API answers only with the pod's secret, a file in its token dir.
  until body=$(curl -fsS -H "Authorization: Bearer $(cat "$FENCEDLEASE_API_SECRET_FILE" 2>/dev/null)" \
    "$FENCEDLEASE_URL/v1/token" 2>/dev/null); do sleep 0.05; done
  FENCEDLEASE_TOKEN=$(echo "$body" | sed -n 's/.*"token":\([0-9]*\).*/\1/p')
  FENCEDLEASE_LEASE_UID=$(echo "$body" | sed -n 's/.*"leaseUID":"\([^"]*\)".*/\1/p')
fi
say() { echo "$(date +%s%N) $FENCEDLEASE_IDENTITY (token $FENCEDLEASE_TOKEN): $*" >>"$timeline"; }
items=$(kubectl -n "$FENCEDLEASE_NAMESPACE" get configmap "$cm" -o jsonpath='{.data.items}')
reservations=$(kubectl -n "$FENCEDLEASE_NAMESPACE" get configmap "$cm" -o jsonpath='{.data.reservations}')
say "reads $cm: $items item(s) left, reserved by: ${reservations:-nobody}"
if [ "${items:-0}" -gt 0 ]; then
  # A reservation already under way is finished before honouring a stop, as real apps do.
  trap '' TERM
  sleep "$think"
  # Every write presents its token itself: the token, the lease uid and a write id never used
  # before (the webhook refuses an update whose write id is the stored one: its token was inherited).
  patch=$(printf '{"metadata":{"annotations":{"fencedlease.io/token":"%s","fencedlease.io/lease-uid":"%s","fencedlease.io/write-id":"%s"}},"data":{"items":"%s","reservations":"%s"}}' \
    "$FENCEDLEASE_TOKEN" "$FENCEDLEASE_LEASE_UID" "$(date +%s%N)-$$" "$((items - 1))" "${reservations:+$reservations }$FENCEDLEASE_IDENTITY")
  if out=$(kubectl -n "$FENCEDLEASE_NAMESPACE" patch configmap "$cm" --type merge -p "$patch" 2>&1); then
    say "writes its reservation: ACCEPTED"
  else
    say "writes its reservation: REFUSED by the API server: ${out#*denied the request: }"
  fi
  trap - TERM
fi
while :; do sleep 1; done
