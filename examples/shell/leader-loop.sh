#!/bin/sh
# A shell app beside the fencedlease sidecar: works only while its pod leads, and sends the
# fencing token with every write. Needs only curl and sed.
#
#   FENCEDLEASE_URL   the sidecar API (the injector sets it; default http://127.0.0.1:8787)
#   FENCEDLEASE_API_SECRET_FILE
#                     the pod's API secret, sent with every request (the injector sets it;
#                     default /var/run/fencedlease/api-secret)
#   WORK              what to run for each unit of work, with $TOKEN and $LEASE_UID set
#                     (default: print them)
set -u
url="${FENCEDLEASE_URL:-http://127.0.0.1:8787}"
secret_file="${FENCEDLEASE_API_SECRET_FILE:-/var/run/fencedlease/api-secret}"
work="${WORK:-echo \"working with token \$TOKEN (lease uid \$LEASE_UID)\"}"

while :; do
  # 200 {"token":N,"leaseUID":"..."} while leading; 409 while not.
  # (401 without the pod's secret: the file is read afresh, the sidecar writes it at start.)
  auth="Authorization: Bearer $(cat "$secret_file" 2>/dev/null)"
  body=$(curl -fsS -H "$auth" "$url/v1/token" 2>/dev/null) || { sleep 1; continue; }
  TOKEN=$(echo "$body" | sed -n 's/.*"token":\([0-9]*\).*/\1/p')
  LEASE_UID=$(echo "$body" | sed -n 's/.*"leaseUID":"\([^"]*\)".*/\1/p')
  export TOKEN LEASE_UID
  # The token may be stale by the time the write lands: that is what the protected resource
  # (the fencing webhook, or your database's conditional update) is for.
  sh -c "$work"
  sleep 1
done
