#!/bin/sh
# Run by `fencedlease campaign`: reserve ITEM in PostgreSQL, sending the fencing token.
#   reserve.sh ITEM WHO THINK_SECONDS      (PGHOST, PGPORT, PGUSER, PGDATABASE select the database)
item=$1 who=$2 think=${3:-0}
read -r left reserved <<EOF2
$(psql -XAtq -F ' ' -v item="$item" <<'SQL'
SELECT left_in_stock, array_to_string(reserved_by, ',') FROM inventory WHERE item = :'item';
SQL
)
EOF2
echo "$(date +%T.%N | cut -c1-12) $who (token $FENCEDLEASE_TOKEN) reads: $left left"
trap '' TERM   # finish the reservation under way, as a real app would
sleep "$think"
# A blind write of what it computed: one fewer in stock, and its name added to what it read.
ok=$(psql -XAtq -v ON_ERROR_STOP=1 -v item="$item" -v left="$((left - 1))" \
  -v reserved="{${reserved:+$reserved,}$who}" -v token="$FENCEDLEASE_TOKEN" -v uid="$FENCEDLEASE_LEASE_UID" <<'SQL'
SELECT fenced_write(:'item', :'left'::integer, :'reserved'::text[], :'token'::bigint, :'uid');
SQL
)
if [ "$ok" = t ]; then verdict=ACCEPTED; else verdict="REFUSED by the database (stale token)"; fi
echo "$(date +%T.%N | cut -c1-12) $who (token $FENCEDLEASE_TOKEN) reserves: $verdict"
trap - TERM
while :; do sleep 1; done
