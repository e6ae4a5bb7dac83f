#!/bin/sh
# The command `fencedlease campaign` runs while leading, in the failover benchmarks: one fenced
# write (a merge patch of the lane's protected ConfigMap carrying the token and lease uid it was
# handed) through the API server, so through the fencing webhook; then it idles until stopped.
# It appends {t_ns, identity, event: "write", code, token} to $BENCH_WRITES when the answer came.
start=$(date +%s%N)
code=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 --cacert "$BENCH_CA" \
  -H "Authorization: Bearer $BENCH_API_TOKEN" -H 'Content-Type: application/merge-patch+json' \
  -X PATCH --data "{\"metadata\":{\"annotations\":{\"fencedlease.io/token\":\"$FENCEDLEASE_TOKEN\",\"fencedlease.io/lease-uid\":\"$FENCEDLEASE_LEASE_UID\",\"fencedlease.io/write-id\":\"$(date +%s%N)-$$\"}},\"data\":{\"writer\":\"$FENCEDLEASE_IDENTITY\"}}" \
  "$BENCH_API/api/v1/namespaces/$FENCEDLEASE_NAMESPACE/configmaps/$BENCH_CM")
end=$(date +%s%N)
echo "{\"t_ns\":$end,\"start_ns\":$start,\"identity\":\"$FENCEDLEASE_IDENTITY\",\"event\":\"write\",\"code\":${code:-0},\"token\":$FENCEDLEASE_TOKEN}" >>"$BENCH_WRITES"
exec sleep 100000
