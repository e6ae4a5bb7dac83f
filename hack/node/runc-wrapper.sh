#!/bin/sh
# runc, minus negative OOM score adjustments. containerd runs this as its runc (the runtime's
# BinaryName in the config hack/node.sh writes).
#
# Why: the kubelet asks for oom_score_adj -998 for every pod sandbox (and -997 for Guaranteed
# containers). These build machines refuse a negative oom_score_adj even to root, and runc then
# fails with "can't get final child's PID from pipe: EOF" (its log: "failed to update
# /proc/self/oom_score_adj: Permission denied"). Before `runc create|run` (bundle config.json)
# and `runc exec` (process JSON), this raises a negative "oomScoreAdj" to 0 and then execs the
# real runc with the same arguments. Nothing else is changed.
#
# Environment: FL_RUNC (the real runc, default /usr/sbin/runc), FL_RUNC_WRAPPER_LOG (a file
# to note each adjustment in; optional).
set -eu

real="${FL_RUNC:-/usr/sbin/runc}"
[ -x "$real" ] || real=/usr/bin/runc

note() {
  [ -n "${FL_RUNC_WRAPPER_LOG:-}" ] || return 0
  printf '%s runc-wrapper: %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "$*" >>"$FL_RUNC_WRAPPER_LOG" 2>/dev/null || true
}

# raise FILE: rewrite a negative "oomScoreAdj" in the JSON FILE to 0, in place.
raise() {
  [ -f "$1" ] || return 0
  if grep -Eq '"oomScoreAdj"[[:space:]]*:[[:space:]]*-[0-9]' "$1"; then
    sed -i -E 's/("oomScoreAdj"[[:space:]]*:[[:space:]]*)-[0-9]+/\10/' "$1"
    note "raised a negative oomScoreAdj to 0 in $1"
  fi
}

# Find the subcommand (skipping runc's global options and their values) and the file it reads.
cmd="" file="" prev=""
for arg in "$@"; do
  if [ -z "$cmd" ]; then
    case "$prev" in
      --root|--log|--log-format|--criu|--rootless) prev=""; continue ;;
    esac
    case "$arg" in
      -*) prev="$arg" ;;
      *) cmd="$arg" ;;
    esac
    continue
  fi
  case "$cmd:$prev" in
    create:--bundle|create:-b|run:--bundle|run:-b|exec:--process|exec:-p) file="$arg" ;;
  esac
  case "$cmd:$arg" in
    create:--bundle=*|run:--bundle=*) file="${arg#--bundle=}" ;;
    exec:--process=*) file="${arg#--process=}" ;;
  esac
  prev="$arg"
done

case "$cmd" in
  create|run) raise "${file:-.}/config.json" ;;
  exec) [ -n "$file" ] && raise "$file" ;;
esac
exec "$real" "$@"
