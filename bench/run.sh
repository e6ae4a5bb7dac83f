#!/usr/bin/env bash
# fencedlease benchmarks, side by side with client-go's leader election (issue 9).
#
#   bench/run.sh [--quick|--full] [--debug] [NAME...]
#
# NAMEs (default: all, in this order):
#   decision           criterion: fencing::decide, admission parse/respond (cargo bench)
#   failover-kill      SIGKILL of the holder: time to the next leader and its first fenced write
#   failover-stop      SIGSTOP of the holder for longer than the lease
#   failover-term      SIGTERM of the holder: graceful handover
#   failover-podgone   SIGKILL of the holder and force-deletion of its pod (a known death, issue 17),
#                      with the controller running: time from the deletion to the next leader;
#                      also fencedlease with revokeOnHolderDeath: false
#   failover-exited    the holder's campaigning container SIGKILLed on a real node (issue 17): the
#                      candidates run in pods (the injected sidecar; client-go's example in an
#                      image), the kubelet restarts the container: time from the kill to the next
#                      holder the API server records. Starts hack/node.sh for the bench cluster
#                      (one kubelet per machine: another node must be down) before it, and
#                      stops it after it.
#   failover-load-kill failover-kill under load (issue 21): a load generator sends ConfigMap writes
#                      and LISTs to the API server at stated rates (bench/load.py; full: 100
#                      writes/s + 10 lists/s of 500 ConfigMaps; quick: 20 + 2 of 100) and every
#                      candidate of both systems reaches it through a proxy adding 20 ms each way;
#                      the harness's own reads go straight to the API server
#   failover-load-stop failover-stop under the same load and delay
#   failover-lists-kill
#                      failover-kill under a list-heavy load (issue 38): closed-loop clients each
#                      LIST all the ConfigMaps of a namespace back to back for the whole run (full:
#                      4 clients, 1,000 ConfigMaps of 1 KB; quick: 1 client, 20), straight to the
#                      API server, as the candidates are (no delay proxy); each fencedlease
#                      takeover's lateness is split into watch lag, timer slack, the acquiring
#                      write and answer -> leading, from the elector's timeline (bench/takeover.py)
#   apiload            requests/s per candidate and holder, idle and during failover, N = 2, 10, 100
#   webhook-server     the HTTPS webhook alone under load, allowed and refused reviews (reviews/s
#                      per core, p50/p99 at 0.5 and 0.8 of the most)
#   webhook-apiserver  a protected ConfigMap update through the API server, with vs without
#   webhook-concurrent W writers at once through the API server (16 and 64; quick: 4 and 16),
#                      allowed, plain and refused writes, the webhook registered by a Service
#                      (HTTP/1.1 from the API server), one and two replicas; each size back to
#                      back (saturation), then paced at half the rate it reached there, where the
#                      allowed/plain p99 ratio is judged (issue 38)
#   policy-concurrent  the same writers and pacing in a namespace the chart's fencing policy
#                      judges (policy mode), no webhook: the policy's ratio beside the webhook's
#   webhook-sharing    the same writers against one replica twice, its fresh reads shared by
#                      concurrent writes (as it runs) and sent per write (--no-shared-reads)
#   policy-apiserver   the same update three ways in one run: no fencing, the webhook, the policy
#                      (policy mode, issue 18): added latency, client side and the API server's own
#   policy-layout      policy mode at scale (issue 37): the chart's one binding, whose paramRef
#                      selects the written object's namespace's FencedLeases; 100 namespaces of
#                      100 leases, then one more of 10,000 (quick: 10 x 10 and 1 x 100): the
#                      validating step against one lease's, the webhook's beside it at 10,000
#                      leases, the API server's memory for the policy machinery. (policy-scale,
#                      0.2.0's one binding per lease, is kept in the record; it no longer runs.)
#   controller-scale   1,000 and 10,000 FencedLeases: RSS, reconcile-all time, idle CPU, expiry notice
#   footprint          one sidecar's RSS and CPU, leading and following, idle; the API proxy's
#                      added latency per write (direct vs through the proxy, same run); the
#                      same idle figures for the sidecar's build (Cargo.toml: no `operator`
#                      feature, profile sidecar; --debug: sidecar-dev), which the script builds
#                      into target/sidecar/ (a second build of every dependency the first time)
#   many-leases        N leases renewing with 2 candidates each (1,000; quick: 20), fencedlease's
#                      electors beside client-go's in one process each: the API server's lease
#                      requests/s, its CPU and RSS, renewal lateness; also client-go with a 500 ms
#                      retry period (100 leases in full mode), for its polling's cost (not on 1.20.2)
#
# After each benchmark, the benchmarks' namespaces are deleted and waited for (bench/settle.py),
# so that the next one starts on an API server without their objects.
#
# --quick (default): small sizes, about 4 minutes after the builds; checks that every command works and exits 0
#   whatever the numbers. --full: the sizes of the record (all 20; in the record's runs of
#   2026-12-02 the first 17 took 88 minutes after the builds, settling included, and
#   webhook-sharing 442 s; BENCHMARKS.md has each one's).
# --no-record (full mode): keep the run in bench/results/full-<time>/ without folding it into the
#   record: a measurement to read beside the record, not to replace any of it.
# --debug (quick mode only): use the unoptimized build the test suite already made instead of a
#   release build; CI runs `bench/run.sh --quick --debug` to keep every command working.
#
# Kubernetes: FL_BENCH_K8S_VERSION (default $FL_K8S_DEFAULT_VERSION of hack/lib.sh, the tests' current
# release, 1.37.2; 1.20.2, the oldest supported, the release of the first records, is selectable)
# is both the API server's release and the client-go peer's: client-go's leader-election example of
# that release (client-go v0.MINOR.PATCH).
# FL_BUILD_LOCK=FILE: every build it starts (cargo, go) holds that flock first, so that builders
# sharing a machine take turns (see with_build_lock in hack/lib.sh).
#
# It builds what it needs (fencedlease in release mode, the bench binaries, the client-go peer
# of that release, see bench/build-peer.sh; the same kube-apiserver as the tests' one of that
# release with finer admission latency buckets, see bench/build-apiserver.sh), starts its OWN local Kubernetes
# (/tmp/fencedlease-bench-cluster, apiserver on 127.0.0.1:28443: not the tests' instance), and
# stops it again at the end, with every process it started. Results: bench/results/<mode>-<time>/
# (one JSON per benchmark, summary.json, tables.md, plots/; versions.json and summary.json say
# which server and peer ran). A full run in which every benchmark it ran succeeded also folds
# them into the record, bench/results/full-record/ (bench/record.py: each benchmark from the newest
# full run that ran it, all on one Kubernetes release: a run on another release first moves the
# record to bench/results/full-record-k8s-<its release>/), and refreshes
# bench/results/summary-full.json and bench/plots/*.svg from the record.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
# shellcheck source=hack/lib.sh
source "$REPO/hack/lib.sh"

MODE=quick
PROFILE=release
NO_RECORD=
NAMES=()
for a in "$@"; do
  case "$a" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --debug) PROFILE=debug ;;
    --no-record) NO_RECORD=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) die "unknown option $a (use --quick or --full, --no-record, --debug)" ;;
    *) NAMES+=("$a") ;;
  esac
done
ALL=(decision failover-kill failover-stop failover-term failover-podgone failover-exited failover-load-kill
  failover-load-stop failover-lists-kill apiload webhook-server
  webhook-apiserver webhook-concurrent webhook-sharing policy-concurrent policy-apiserver policy-layout controller-scale
  footprint many-leases)
[ ${#NAMES[@]} -eq 0 ] && NAMES=("${ALL[@]}")
for n in "${NAMES[@]}"; do
  [[ " ${ALL[*]} " == *" $n "* ]] || die "unknown benchmark $n (one of: ${ALL[*]})"
done
if [ -n "$NO_RECORD" ] && [ "$MODE" != full ]; then
  die "--no-record is for full runs (a quick run never folds into the record): add --full or drop it"
fi
if [ "$PROFILE" = debug ] && [ "$MODE" = full ]; then
  die "--debug is for checking that the commands work (CI); the record needs release binaries: drop --debug"
fi

# The release of the API server and of the client-go peer (hack/cluster.sh and
# hack/k8s-binaries.sh read FL_K8S_VERSION).
BENCH_K8S="${FL_BENCH_K8S_VERSION:-$FL_K8S_DEFAULT_VERSION}"
[[ "$BENCH_K8S" =~ ^1\.[0-9]+\.[0-9]+$ ]] || die "FL_BENCH_K8S_VERSION=$BENCH_K8S: expected a release like $FL_K8S_DEFAULT_VERSION or $FL_K8S_LEGACY_VERSION"
export FL_K8S_VERSION="$BENCH_K8S"

# Our own cluster instance, never the tests' one.
export FENCEDLEASE_CLUSTER_DIR="${FL_BENCH_CLUSTER_DIR:-/tmp/fencedlease-bench-cluster}"
# Ports below Linux's ephemeral range (32768-60999), where an outgoing connection can hold them.
export FL_ETCD_PORT="${FL_BENCH_ETCD_PORT:-28379}" FL_ETCD_PEER_PORT="${FL_BENCH_ETCD_PEER_PORT:-28380}"
export FL_APISERVER_PORT="${FL_BENCH_APISERVER_PORT:-28443}" FL_KCM_PORT="${FL_BENCH_KCM_PORT:-28257}"
export FL_BENCH_CACHE="${FL_BENCH_CACHE:-$FL_CACHE/bench}"
export FL_BENCH_WORK="${FL_BENCH_WORK:-/tmp/fencedlease-bench-work}"
export KUBECONFIG="$FENCEDLEASE_CLUSTER_DIR/kubeconfig"
# One run per instance (cluster folder, ports, work folder): a second one would stop the first's
# cluster and replace its binaries. Another instance runs beside it with its own FL_BENCH_*.
RUN_PIDFILE="$FENCEDLEASE_CLUSTER_DIR.run-pid"
if other="$(cat "$RUN_PIDFILE" 2>/dev/null)" && [ "$other" != $$ ] &&
  grep -qa "run.sh" "/proc/$other/cmdline" 2>/dev/null; then
  die "another bench/run.sh (pid $other) uses this instance ($FENCEDLEASE_CLUSTER_DIR, port $FL_APISERVER_PORT, $FL_BENCH_WORK): wait for it, or run beside it with FL_BENCH_CLUSTER_DIR, FL_BENCH_WORK and the FL_BENCH_*_PORT variables set to others"
fi
echo $$ >"$RUN_PIDFILE"
# This run's binaries: private copies in the instance's work folder (a build, or a run with
# another FL_BENCH_WORK, cannot replace them meanwhile); the cache keeps only what is built once.
export FL_BENCH_BINDIR="$FL_BENCH_WORK/bin"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$HERE/results/$MODE-$STAMP"
mkdir -p "$OUT" "$FL_BENCH_CACHE" "$FL_BENCH_WORK" "$FL_BENCH_BINDIR"
log "benchmarks ($MODE, $PROFILE build, Kubernetes v$BENCH_K8S, client-go peer of v$BENCH_K8S): ${NAMES[*]}; results in $OUT"

command -v python3 >/dev/null || apt_install python3
command -v curl >/dev/null || apt_install curl
command -v taskset >/dev/null || apt_install util-linux

# -- build ---------------------------------------------------------------------------------------
cd "$REPO"
if [ "$PROFILE" = release ]; then
  with_heartbeat "cargo build --release" "$OUT/build.log" with_build_lock cargo build --release
  # The bench tools in a profile of their own (Cargo.toml: bench-tools, in target/bench-tools/):
  # `cargo bench` would build the fencedlease binary too, with other settings, into
  # target/release/, over the one just built.
  with_heartbeat "cargo build --profile bench-tools --benches" "$OUT/build-benches.log" \
    with_build_lock cargo build --profile bench-tools --benches --message-format=json
else
  # Unoptimized: what the test suite built already, so CI pays for no release build (only, for
  # footprint, the sidecar's debug build below). The figures mean nothing; the commands are
  # what is checked.
  with_heartbeat "cargo build (debug)" "$OUT/build.log" with_build_lock cargo build
  with_heartbeat "cargo build --benches (debug)" "$OUT/build-benches.log" \
    with_build_lock cargo build --benches --message-format=json
fi
# Private copies: other builds may replace target/ while the benchmarks run.
cp "${CARGO_TARGET_DIR:-target}/$PROFILE/fencedlease" "$FL_BENCH_BINDIR/fencedlease"
SIDECAR_BUILD=()
# footprint also measures the sidecar's build (Cargo.toml: without the default `operator`
# feature), in a target folder of its own so that it never replaces the binary above.
if [[ " ${NAMES[*]} " == *" footprint "* ]]; then
  with_heartbeat "cargo build --profile $(sidecar_profile "$PROFILE") --no-default-features (the sidecar's build)" \
    "$OUT/build-sidecar.log" build_sidecar "$PROFILE"
  cp "$(sidecar_binary "$PROFILE")" "$FL_BENCH_BINDIR/fencedlease-sidecar"
  SIDECAR_BUILD=(--sidecar-binary "$FL_BENCH_BINDIR/fencedlease-sidecar")
fi
bench_exe() { # NAME: the bench executable that the build above produced
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[2]:
        print(m["executable"])' "$OUT/build-benches.log" "$1" | tail -1
}
LOADER=$(bench_exe webhook_load)
DECISION=$(bench_exe webhook_decision)
MANY=$(bench_exe many_leases)
WRITERS=$(bench_exe apiserver_writers)
[ -n "$LOADER" ] && [ -n "$DECISION" ] && [ -n "$MANY" ] && [ -n "$WRITERS" ] || die "could not find the bench executables (see $OUT/build-benches.log)"
cp "$DECISION" "$FL_BENCH_BINDIR/webhook_decision"
cp "$LOADER" "$FL_BENCH_BINDIR/webhook_load"
cp "$MANY" "$FL_BENCH_BINDIR/many_leases"
cp "$WRITERS" "$FL_BENCH_BINDIR/apiserver_writers"
# The peer: client-go's leader-election example of the same release (bench/build-peer.sh).
FL_BENCH_PEER="$("$HERE/build-peer.sh" "$BENCH_K8S")"
export FL_BENCH_PEER FL_BENCH_PEER_VERSION="$BENCH_K8S"
# many-leases' client-go side: N×C LeaderElectors in one process (bench/build-many-peer.sh), on
# releases whose client-go is a published module (not 1.20.2).
MANY_PEER=""
if [[ " ${NAMES[*]} " == *" many-leases "* ]] && [ "$BENCH_K8S" != "$FL_K8S_LEGACY_VERSION" ]; then
  MANY_PEER="$("$HERE/build-many-peer.sh" "$BENCH_K8S")"
fi
# The benchmarks' kube-apiserver: the tests' one of that release with finer admission latency
# buckets, so that the webhook-apiserver benchmark can read the API server's own timing of each
# webhook call (bench/build-apiserver.sh says what differs: nothing else).
WHA_EXPECT=()
if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
  log "KUBEBUILDER_ASSETS is set: its kube-apiserver runs the benchmarks (whatever its release; the peer is client-go of v$BENCH_K8S); its webhook latency histogram has Kubernetes' default buckets (from 5 ms), so webhook-apiserver reports the API server's timing only as an upper bound"
else
  KUBEBUILDER_ASSETS="$("$HERE/build-apiserver.sh" "$BENCH_K8S")"
  export KUBEBUILDER_ASSETS
  WHA_EXPECT=(--expect-fine-buckets)
fi

# -- the cluster ---------------------------------------------------------------------------------
cleanup() {
  local rc=$?
  # The benchmarks stop what they start; as a safety net, kill the process groups whose ids
  # they recorded, if those processes still run one of our binaries.
  if [ -f "$FL_BENCH_WORK/pids" ]; then
    while read -r pid; do
      if grep -qa -e "$FL_BENCH_BINDIR" -e "$FL_BENCH_CACHE" -e "$HERE" "/proc/$pid/cmdline" 2>/dev/null; then
        kill -CONT -- "-$pid" 2>/dev/null || true
        kill -KILL -- "-$pid" 2>/dev/null || true
      fi
    done <"$FL_BENCH_WORK/pids"
    rm -f "$FL_BENCH_WORK/pids"
  fi
  [ "${NODE_STARTED:-0}" = 1 ] && { env -u KUBEBUILDER_ASSETS "$REPO/hack/node.sh" down || true; }
  "$REPO/hack/cluster.sh" down || true
  rm -f "$RUN_PIDFILE"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# A fresh instance: no objects left from an earlier run (10,000 leases would skew the next one).
"$REPO/hack/cluster.sh" down
"$REPO/hack/cluster.sh" up
# failover-exited runs its candidates in pods: a node (kubelet + containerd) for this cluster,
# with the project's image and the peer's. The node runs for that benchmark alone: beside the
# others its kubelet and scheduler would take CPU, and run the pods failover-podgone only stores.
PEER_IMAGE=""
if [[ " ${NAMES[*]} " == *" failover-exited "* ]]; then
  [ -z "$(pgrep -x kubelet || true)" ] ||
    die "failover-exited needs this machine's one node, and a kubelet runs already (stop it: hack/node.sh down, with the settings of the cluster it belongs to), or leave failover-exited out"
fi
node_up() {
  NODE_STARTED=1
  # The kubelet and scheduler of the tests' build of that release (KUBEBUILDER_ASSETS names the
  # benchmarks' API server folder, which has neither).
  env -u KUBEBUILDER_ASSETS "$REPO/hack/node.sh" up
  FL_IMAGE_BINARY="$FL_BENCH_BINDIR/fencedlease" "$REPO/hack/image.sh"
  PEER_IMAGE="$("$HERE/peer-image.sh" "$FL_BENCH_PEER" "$BENCH_K8S")"
}
node_down() {
  env -u KUBEBUILDER_ASSETS "$REPO/hack/node.sh" down
  NODE_STARTED=0
}

python3 -c 'import json,sys; sys.path.insert(0, sys.argv[1]); import lib; print(json.dumps(lib.machine_info(), indent=1))' \
  "$HERE" >"$OUT/machine.json"
# Which server and peer ran: the running API server's /version and the peer's build.
python3 -c 'import json,sys; sys.path.insert(0, sys.argv[1]); import lib; print(json.dumps(lib.versions(), indent=1))' \
  "$HERE" >"$OUT/versions.json"
log "machine: $(nproc) cores, load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
log "versions: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["server"], "/", d["peer"])' "$OUT/versions.json")"

# -- the benchmarks -------------------------------------------------------------------------------
if [ "$MODE" = full ]; then
  CRIT=(--warm-up-time 1 --measurement-time 4)
  FAIL=(--lease 15 --lanes 8 --trials 12)
  TERM_=(--lease 15 --lanes 8 --trials 25)
  GONE=(--lease 15 --lanes 5 --trials 20)
  EXITED=(--lease 15 --lanes 3 --trials 15)
  LOADED=(--lease 15 --lanes 6 --trials 10 --load-writes 100 --load-lists 10 --load-objects 500 --delay-ms 20)
  LISTS=(--lease 15 --lanes 4 --trials 25 --load-list-clients 4 --load-objects 1000 --load-object-bytes 1024)
  API=(--n 2 10 100 --lease 15 --warmup 17 --idle 45)
  WHS=(--seconds 20 --warmup 3 --fractions 0.5 0.8 --repeat 3)
  WHA=(--updates 5000 --updates-warmup 50 --repeat 3)
  WHC=(--writers 16 64 --replicas 1 2 --writes 300 --warmup 10 --paced-rate half --paced-writes 60 --lease-reads 2000)
  WHS_PACE=150
  VAP=(--updates 2000 --updates-warmup 50 --repeat 3)
  VAPL=(--per 100 --updates 500 --updates-warmup 20 --max-seconds 90 --settle 30 --idle 30)
  CTL=(--n 1000 10000 --probes 5 --probe-lease 3 --idle-window 60)
  FOOT=(--sidecars 3 --lease 15 --warmup 20 --window 120 --writes 2000 --writes-warmup 50)
  MANYL=(--n 1000 --fast-n 100 --candidates 2 --lease 15 --window 60 --baseline 20)
else
  CRIT=(--warm-up-time 0.1 --measurement-time 0.3 --sample-size 10 --nresamples 1000)
  FAIL=(--lease 3 --lanes 1 --trials 2)
  TERM_=(--lease 3 --lanes 1 --trials 3)
  GONE=(--lease 3 --lanes 1 --trials 2)
  EXITED=(--lease 3 --lanes 1 --trials 2 --no-opt-out)
  LOADED=(--lease 3 --lanes 1 --trials 2 --load-writes 20 --load-lists 2 --load-objects 100 --delay-ms 20)
  LISTS=(--lease 3 --lanes 1 --trials 2 --load-list-clients 1 --load-objects 20 --load-object-bytes 1024)
  API=(--n 2 10 --lease 3 --warmup 4 --idle 5)
  WHS=(--seconds 2 --warmup 0.5 --fractions 0.5)
  WHA=(--updates 50 --updates-warmup 10)
  WHC=(--writers 4 16 --replicas 1 2 --writes 10 --warmup 2 --paced-rate half --paced-writes 4 --lease-reads 100)
  WHS_PACE=100
  VAP=(--updates 30 --updates-warmup 5)
  VAPL=(--per 10 --updates 30 --updates-warmup 5 --settle 2 --idle 2)
  CTL=(--n 200 --probes 1 --probe-lease 2 --idle-window 3)
  FOOT=(--sidecars 2 --lease 3 --warmup 2 --window 3 --writes 30 --writes-warmup 5)
  MANYL=(--n 20 --candidates 2 --lease 6 --window 8 --baseline 3)
fi

FAILED=()
bench() { # NAME CMD...
  local name="$1"; shift
  log "== $name"
  local start=$SECONDS
  if (cd "$HERE" && "$@"); then
    # Every benchmark but decision (criterion's folder) leaves NAME.json, which report.py and
    # record.py read: a missing one would drop the benchmark from the tables unnoticed.
    if [ "$name" != decision ] && [ ! -f "$OUT/$name.json" ]; then
      log "== $name: FAILED: it wrote no $OUT/$name.json"
      FAILED+=("$name")
    else
      log "== $name: done in $((SECONDS - start)) s"
    fi
  else
    log "== $name: FAILED after $((SECONDS - start)) s"
    FAILED+=("$name")
  fi
  settle "$name"
}
# The next benchmark starts without this one's namespaces and what they held (bench/settle.py).
settle() { # NAME
  [ "$1" = decision ] && return
  if ! (cd "$HERE" && python3 settle.py --timeout 600); then
    log "== $1: FAILED: its namespaces did not go, and the next benchmarks would run beside them"
    FAILED+=("$1 (settle)")
  fi
}
crit() {
  # The executable built at the start (what `cargo bench --bench webhook_decision` runs), so
  # that edits to src/ made meanwhile do not rebuild or change it mid-run.
  rm -rf "$OUT/criterion"
  with_heartbeat "webhook_decision (criterion)" "$OUT/decision.log" \
    env CRITERION_HOME="$OUT/criterion" "$FL_BENCH_BINDIR/webhook_decision" --bench "${CRIT[@]}"
  grep -E "time:|^[a-z_]+/[A-Za-z0-9_]+$" "$OUT/decision.log" >&2 || true
}

for n in "${NAMES[@]}"; do
  case "$n" in
    decision) bench decision crit ;;
    failover-kill) bench "$n" python3 failover.py kill "${FAIL[@]}" --out "$OUT" ;;
    failover-stop) bench "$n" python3 failover.py stop "${FAIL[@]}" --out "$OUT" ;;
    failover-term) bench "$n" python3 failover.py term "${TERM_[@]}" --out "$OUT" ;;
    failover-podgone) bench "$n" python3 failover.py podgone "${GONE[@]}" --out "$OUT" ;;
    failover-exited)
      node_up
      bench "$n" python3 failover_node.py "${EXITED[@]}" --peer-image "$PEER_IMAGE" --out "$OUT"
      node_down ;;
    failover-load-kill) bench "$n" python3 failover.py kill "${LOADED[@]}" --out "$OUT" ;;
    failover-load-stop) bench "$n" python3 failover.py stop "${LOADED[@]}" --out "$OUT" ;;
    failover-lists-kill) bench "$n" python3 failover.py kill "${LISTS[@]}" --out "$OUT" ;;
    apiload) bench "$n" python3 apiload.py "${API[@]}" --out "$OUT" ;;
    webhook-server) bench "$n" python3 webhook_bench.py server "${WHS[@]}" --out "$OUT" ;;
    webhook-apiserver) bench "$n" python3 webhook_bench.py apiserver "${WHA[@]}" "${WHA_EXPECT[@]}" --out "$OUT" ;;
    webhook-concurrent) bench "$n" python3 webhook_concurrent.py "${WHC[@]}" --out "$OUT" ;;
    webhook-sharing) # webhook-concurrent's sizes, one replica (a later --replicas wins)
      # A fixed pace (a later --paced-rate wins): half of each mode's own saturation would pace
      # the shared and the per-request reads at different rates.
      bench "$n" python3 webhook_concurrent.py "${WHC[@]}" --replicas 1 --reads shared per-request \
        --paced-rate "$WHS_PACE" --name "$n" --out "$OUT" ;;
    policy-concurrent) # webhook-concurrent's sizes and pacing, the policy judging
      bench "$n" python3 webhook_concurrent.py "${WHC[@]}" --fence policy --name "$n" --out "$OUT" ;;
    policy-apiserver) bench "$n" python3 policy_bench.py apiserver "${VAP[@]}" "${WHA_EXPECT[@]}" --out "$OUT" ;;
    policy-layout) bench "$n" python3 policy_bench.py layout "${VAPL[@]}" "${WHA_EXPECT[@]}" --out "$OUT" ;;
    controller-scale) bench "$n" python3 controller_scale.py "${CTL[@]}" --out "$OUT" ;;
    footprint) bench "$n" python3 footprint.py "${FOOT[@]}" "${SIDECAR_BUILD[@]}" --out "$OUT" ;;
    many-leases)
      if [ -n "$MANY_PEER" ]; then
        bench "$n" python3 many_leases.py "${MANYL[@]}" --ours "$FL_BENCH_BINDIR/many_leases" --peer "$MANY_PEER" --out "$OUT"
      else
        log "== many-leases: skipped on v$BENCH_K8S (its client-go is built from Debian's tree, not a module)"
        echo '{"benchmark": "many-leases", "skipped": "client-go of this release is not a published module here"}' >"$OUT/many-leases.json"
      fi ;;
  esac
done

python3 -c 'import json,sys; sys.path.insert(0, sys.argv[1]); import lib; print(json.dumps(lib.machine_info(), indent=1))' \
  "$HERE" >"$OUT/machine-after.json"
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
JUDGE=()
[ "$MODE" = quick ] && JUDGE=(--no-judge)
python3 "$HERE/report.py" "$OUT" --plots "$OUT/plots" --criterion "$OUT/criterion" "${JUDGE[@]}" >"$OUT/report.log"
cat "$OUT/tables.md" >&2
if [ ${#FAILED[@]} -gt 0 ]; then
  die "these benchmarks failed: ${FAILED[*]} (logs: $OUT, $FL_BENCH_WORK); the record is unchanged"
fi
if [ "$MODE" = full ] && [ -n "$NO_RECORD" ]; then
  log "--no-record: the record is unchanged; this run is kept in $OUT"
elif [ "$MODE" = full ]; then
  # The record: each benchmark from the newest full run that ran it (a run of a few benchmarks
  # replaces only theirs).
  RECORD="$HERE/results/full-record"
  python3 "$HERE/record.py" "$OUT" "${NAMES[@]}" --record "$RECORD" --kubernetes "$BENCH_K8S" --plots "$HERE/plots" \
    --command "bench/run.sh --full ${NAMES[*]}" >&2
  python3 "$HERE/report.py" "$RECORD" --plots "$HERE/plots" --criterion "$RECORD/criterion" \
    >"$OUT/record-report.log"
  cp "$RECORD/summary.json" "$HERE/results/summary-full.json"
  log "recorded: bench/results/full-record/, summary-full.json, tables.md and bench/plots/"
fi
log "all benchmarks ran ($MODE); results in $OUT"
