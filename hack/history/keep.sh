#!/usr/bin/env bash
# Keeps a history run in the repository: its summary as is, and everything the checker reads
# (the apps' ops, the candidates' events, the audit logs, the watch's points, the final objects,
# the fault log) plus the console output, compressed.
#
#   hack/history/keep.sh RUN_DIR DEST_DIR [CONSOLE_LOG]
#
# To check a kept run again:
#   mkdir /tmp/r && tar -xJf DEST_DIR/raw.tar.xz -C /tmp/r && python3 hack/history/check.py /tmp/r
set -euo pipefail
run=${1:?usage: $0 RUN_DIR DEST_DIR [CONSOLE_LOG]} dest=${2:?usage: $0 RUN_DIR DEST_DIR [CONSOLE_LOG]}
[ -f "$run/summary.json" ] || { echo "$run has no summary.json: not a finished run" >&2; exit 1; }
mkdir -p "$dest"
cp "$run/summary.json" "$dest/summary.json"
[ -n "${3:-}" ] && cp "$3" "$run/console.log"
(cd "$run" && tar -cf - summary.json run.json final-objects.json watch-points.json faults.jsonl audit.log \
  ops-*.jsonl ./*.events $( [ -f audit-2.log ] && echo audit-2.log ) $( [ -f console.log ] && echo console.log )) | xz -9 -T2 >"$dest/raw.tar.xz"
echo "kept $run in $dest: $(du -h "$dest/raw.tar.xz" | cut -f1) compressed"
