#!/usr/bin/env bash
# A real node for the local Kubernetes of hack/cluster.sh: kube-scheduler, containerd and a
# kubelet on this machine, so that pods actually run.
#
#   hack/node.sh up       start it (idempotent: a healthy node is kept; a crashed or partial one
#                         is cleaned up and started afresh). Needs a running control plane:
#                         hack/cluster.sh up, with the same FENCEDLEASE_CLUSTER_DIR / FL_* ports.
#   hack/node.sh down     stop everything it started: no process, mount, network namespace,
#                         bridge or NAT rule is left behind; imported images and logs are kept
#   hack/node.sh status   say what runs and whether the node is Ready
#
# Everything lives under $FENCEDLEASE_CLUSTER_DIR/node (containerd's own config, root and state,
# the kubelet's root, certificates, CNI config); logs go to $FENCEDLEASE_CLUSTER_DIR/logs/
# (containerd.log, kubelet.log, kube-scheduler.log, runc-wrapper.log). Pod logs are where the
# kubelet always puts them, /var/log/pods (`kubectl logs` cannot reach the kubelet, see below).
#
# Networking (verified on these machines; nothing leaves the machine):
#   * A bridge of our own ($FL_NODE_BRIDGE, default flnode0) with ${FL_NODE_SUBNET:-10.213.0}.1/24
#     is the node's address (--node-ip). Pods get ${FL_NODE_SUBNET:-10.213.0}.2-254 in network
#     namespaces made through the CNI bridge plugin, and routes to the bridge subnet and to the
#     `kubernetes` Service IP only. IP forwarding stays off: pods cannot reach the outside.
#   * Pods reach the API server the ordinary in-cluster way: the kubelet injects
#     KUBERNETES_SERVICE_HOST/PORT = the `kubernetes` Service (10.0.0.1:443), and a NAT rule that
#     applies only to packets entering from our bridge sends 10.0.0.1:443 to the API server on
#     127.0.0.1 (route_localnet is enabled on our bridge only). The API server's certificate is
#     valid for 10.0.0.1. There is no kube-proxy: other Service IPs do not work from pods.
#     Service-account tokens are mounted the ordinary way (cluster.sh runs the ServiceAccount
#     admission plugin and the controller-manager's token controller).
#   * hostNetwork pods (not exercised by tests/node_*.rs) share the host's network: they would
#     have to set KUBERNETES_SERVICE_HOST=127.0.0.1 and KUBERNETES_SERVICE_PORT=<API server port>
#     themselves (the NAT rule does not apply to the host's own traffic, on purpose: the
#     default cluster uses the same Service IP). Prefer the pod network.
#   * The API server reaches a webhook Service only by dialing the Service's endpoint (the pod
#     IP, routed over our bridge): cluster.sh runs kube-apiserver with
#     --enable-aggregator-routing=true (without it, the API server dials the ClusterIP, which
#     nothing serves here). tests/node_chart.rs installs the Helm chart and checks both webhooks
#     through the Service.
#   * The kubelet listens on 127.0.0.1 only; the API server dials the node's address, so
#     `kubectl logs/exec` do not work. Read /var/log/pods instead.
#
# Host changes made while the node runs, and undone by `down`: the bridge, a NAT chain
# FLNODE-<bridge> (the kubelet's own iptables chains are switched off), pod network namespaces
# in /var/run/netns, cgroups under /kubepods, /var/lib/kubelet/device-plugins and
# /run/containerd/s (paths fixed in the kubelet and the shims), and the kernel settings the
# kubelet insists on (vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1; saved
# before, restored after).
#
# For tests: the Node object carries the annotation fencedlease.io/containerd-socket (this
# node's containerd socket, for `ctr --address ... --namespace k8s.io tasks pause|resume`, which
# tests/node_frozen.rs uses to freeze a pod), and the pause image ($PAUSE_IMAGE below) doubles as a
# do-nothing app container in test pods.
#
# Versions: the node runs the kubelet and kube-scheduler of $FL_K8S_VERSION (as cluster.sh), which
# must be within the skew policy of the running API server (a kubelet up to three minors older,
# never newer; `up` checks). Run here: v1.20.2 and v1.37.2. What differs, found on this machine:
#   * This machine has cgroup v1 (/sys/fs/cgroup is a tmpfs). kubelet 1.35+ defaults
#     failCgroupV1 to true and refuses to start ("cgroup v1 support is unsupported"): its
#     KubeletConfiguration sets `failCgroupV1: false` (a field 1.20 does not know, so only there).
#   * Flags gone since 1.20: --container-runtime (1.27; remote is the only runtime);
#     --container-runtime-endpoint, --image-service-endpoint and --runtime-request-timeout are
#     configuration fields only in 1.37 (containerRuntimeEndpoint, ...); --pod-infra-container-image
#     is gone (the sandbox image comes from containerd's sandbox_image, which containerd_config
#     sets already); kube-scheduler's --port (1.24+).
#   * Runtime: Debian 12's containerd 1.6.20 runs both (CRI v1, which kubelet 1.26+ requires). It
#     lacks the RuntimeConfig RPC; kubelet 1.37 then takes cgroupDriver from its own config
#     (logging "CRI implementation should be updated to support RuntimeConfig") and counts it in a
#     metric announcing the fallback's end in 1.38.0. For 1.38+ a newer containerd is needed:
#     github.com/containerd/containerd/v2 (served by the Go module proxy; untried here, and
#     whether it still runs on cgroup v1 is unchecked).
#   * The pause image is built from the pause.c of the same release (the 1.20.2 source tree, or
#     the k8s.io/kubernetes module that hack/k8s-binaries.sh downloaded).
#   * Native sidecars (restartable init containers) run on the 1.37 kubelet: the injected sidecar
#     starts before the app and stops after it (tests/node_injection.rs checks both).
#
# Variables: FENCEDLEASE_CLUSTER_DIR, FL_APISERVER_PORT (as for cluster.sh); FL_NODE_NAME (default:
# the host name), FL_NODE_BRIDGE (flnode0), FL_NODE_SUBNET (10.213.0, a /24), FL_KUBELET_PORT
# (10250), FL_KUBELET_HEALTHZ_PORT (10248), FL_SCHEDULER_PORT (10259). One node per machine.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=hack/node/image-lib.sh
source "$(dirname "$0")/node/image-lib.sh"

DIR="$FL_CLUSTER_DIR"
NODE="$DIR/node"
API_PORT="${FL_APISERVER_PORT:-16443}"
ADMIN_KUBECONFIG="$DIR/kubeconfig"
NODE_NAME="${FL_NODE_NAME:-$(hostname | tr '[:upper:]' '[:lower:]')}"
BRIDGE="${FL_NODE_BRIDGE:-flnode0}"
SUBNET="${FL_NODE_SUBNET:-10.213.0}"
NODE_IP="$SUBNET.1"
KUBELET_PORT="${FL_KUBELET_PORT:-10250}"
KUBELET_HEALTHZ_PORT="${FL_KUBELET_HEALTHZ_PORT:-10248}"
SCHED_PORT="${FL_SCHEDULER_PORT:-10259}"
NAT_CHAIN="FLNODE-$BRIDGE"
SOCK="$(node_containerd_socket)"
PAUSE_IMAGE="localhost/fencedlease/pause:3.4"
PAUSE_TAR="$FL_CACHE/images/pause-3.4-k8s-$FL_K8S_VERSION.tar"
WRAPPER="$FL_REPO/hack/node/runc-wrapper.sh"
# The kernel settings the kubelet rewrites when it starts (protectKernelDefaults=false).
SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes)
COMPONENTS=(kube-scheduler kubelet containerd)
RETRY="hack/node.sh down && hack/node.sh up"   # what to try when a start fails

kc() { kubectl --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

control_plane_up() {
  [ -f "$ADMIN_KUBECONFIG" ] && [ -f "$DIR/pki/admin.token" ] || return 1
  curl -fsS --max-time 2 --cacert "$DIR/pki/ca.crt" -H "Authorization: Bearer $(cat "$DIR/pki/admin.token")" \
    "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1
}

# live_kubelets: kubelet processes that still run (zombies do not count).
live_kubelets() {
  local pid
  for pid in $(pgrep -x kubelet || true); do alive "$pid" && echo "$pid"; done
  return 0
}
pid_alive() { [ -f "$NODE/pids/$1" ] && alive "$(cat "$NODE/pids/$1")"; }

node_ready() {
  [ "$(kc get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

healthy() {
  for c in "${COMPONENTS[@]}"; do pid_alive "$c" || return 1; done
  ip link show "$BRIDGE" >/dev/null 2>&1 && control_plane_up && node_ready
}

# Processes of ours whose pid file is gone (a crashed run): their command line names $NODE/.
strays() { # COMM...
  local pid comm
  for pid in $(pgrep -f -- "$NODE/" || true); do
    [ "$pid" = $$ ] && continue
    comm=$(ps -o comm= -p "$pid" 2>/dev/null) || continue
    for c in "$@"; do [ "$comm" = "$c" ] && echo "$pid"; done
  done
}

start() { # NAME CMD... : in its own session, output to logs/NAME.log
  local name="$1"; shift
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$NODE/pids/$name"
}

port_free() { [ -z "$(ss -ltnH "sport = :$1" 2>/dev/null)" ]; }

# ---------------------------------------------------------------------------------- down

# containerd_cleanup: with our containerd answering, kill every task and delete every container
# (their rootfs mounts and shims go with them). Images stay.
containerd_cleanup() {
  local ids id
  ids=$(node_ctr tasks ls -q 2>/dev/null || true)
  for id in $ids; do node_ctr tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  # containerd's CRI plugin deletes most exited tasks itself; delete the rest.
  for _ in $(seq 50); do
    ids=$(node_ctr tasks ls -q 2>/dev/null || true)
    [ -n "$ids" ] || break
    for id in $ids; do node_ctr tasks delete "$id" >/dev/null 2>&1 || true; done
    sleep 0.1
  done
  for id in $(node_ctr containers ls -q 2>/dev/null || true); do
    node_ctr containers delete "$id" >/dev/null 2>&1 || log "could not delete container $id"
  done
}

# kill_cgroup_tree NAME: SIGKILL every process in cgroup NAME of each cgroup-v1 hierarchy.
kill_cgroup_tree() {
  local procs pid
  procs=$(find /sys/fs/cgroup/*/"$1" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u || true)
  for pid in $procs; do kill -KILL "$pid" 2>/dev/null || true; done
  [ -z "$procs" ] || sleep 0.5
}

unmount_under() { # PREFIX: unmount everything mounted below PREFIX, deepest first
  local prefix="$1" m round
  for round in 1 2 3 4 5; do
    local mounts
    mounts=$(findmnt -rn -o TARGET | grep -F -- "$prefix/" | LC_ALL=C sort -r || true)
    [ -n "$mounts" ] || return 0
    for m in $mounts; do umount "$m" 2>/dev/null || { [ $round -ge 3 ] && umount -l "$m" 2>/dev/null; } || true; done
  done
}

# our_netns: the network namespaces (made by containerd for pods) whose veth is on our bridge.
our_netns() {
  local ns peer
  for ns in /var/run/netns/cni-*; do
    [ -e "$ns" ] || continue
    peer=$(ip -n "$(basename "$ns")" -o link show type veth 2>/dev/null | sed -n 's/^[0-9]*: [^@]*@if\([0-9]*\):.*/\1/p') || true
    peer="${peer%%$'\n'*}"
    [ -n "$peer" ] || continue
    case "$(ip -o link show 2>/dev/null | grep -E "^$peer: ")" in
      *" master $BRIDGE "*) basename "$ns" ;;
    esac
  done
}

network_down() {
  local ns
  for ns in $(our_netns); do ip netns delete "$ns" 2>/dev/null || true; done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" 2>/dev/null || true; fi
  if iptables -t nat -S "$NAT_CHAIN" >/dev/null 2>&1; then
    while iptables -t nat -D PREROUTING -i "$BRIDGE" -j "$NAT_CHAIN" 2>/dev/null; do :; done
    iptables -t nat -F "$NAT_CHAIN" && iptables -t nat -X "$NAT_CHAIN"
  fi
}

restore_sysctls() {
  [ -f "$NODE/sysctl.saved" ] || return 0
  local k v
  while read -r k v; do
    [ "$(cat "/proc/sys/$k")" = "$v" ] || echo "$v" >"/proc/sys/$k" 2>/dev/null || log "could not restore $k=$v"
  done <"$NODE/sysctl.saved"
  rm -f "$NODE/sysctl.saved"
}

down() {
  local any=0 c pid
  mkdir -p "$NODE/pids" "$DIR/logs"
  for c in kube-scheduler kubelet; do
    if [ -f "$NODE/pids/$c" ]; then stop_pid "$c" "$(cat "$NODE/pids/$c")"; rm -f "$NODE/pids/$c"; any=1; fi
  done
  for pid in $(strays kube-scheduler kubelet); do stop_pid "stray $(ps -o comm= -p "$pid")" "$pid"; any=1; done

  # containerd cleans up its containers best; after a crash, start it once more to do so.
  local temporary=0
  if ! node_containerd_running && [ -f "$NODE/containerd/config.toml" ] && [ -d "$NODE/containerd/root" ]; then
    for pid in $(strays containerd); do stop_pid "stray containerd" "$pid"; done
    rm -f "$NODE/pids/containerd"
    start containerd env FL_RUNC_WRAPPER_LOG="$DIR/logs/runc-wrapper.log" containerd --config "$NODE/containerd/config.toml"
    for _ in $(seq 100); do node_containerd_running && break; sleep 0.1; done
    temporary=1
  fi
  if node_containerd_running; then
    [ $temporary = 1 ] || any=1
    containerd_cleanup
  fi
  if [ -f "$NODE/pids/containerd" ]; then stop_pid containerd "$(cat "$NODE/pids/containerd")"; rm -f "$NODE/pids/containerd"; fi
  for pid in $(strays containerd containerd-shim); do stop_pid "stray $(ps -o comm= -p "$pid")" "$pid"; any=1; done

  # Whatever container processes are left (containerd could not clean up): the kubelet put them
  # all under the cgroup /kubepods. Only when no other kubelet runs on this machine.
  if [ -z "$(live_kubelets)" ]; then
    kill_cgroup_tree kubepods
    # A cgroup can be removed only once its last process is gone: retry for a few seconds.
    for _ in $(seq 50); do
      find /sys/fs/cgroup/*/kubepods -depth -type d -exec rmdir {} + 2>/dev/null || true
      compgen -G "/sys/fs/cgroup/*/kubepods" >/dev/null || break
      sleep 0.1
    done
    ! compgen -G "/sys/fs/cgroup/*/kubepods" >/dev/null || log "could not remove the cgroups /sys/fs/cgroup/*/kubepods"
  fi
  unmount_under "$NODE"
  network_down
  # The Node object goes too: otherwise it looks Ready for another 40 s, and its pods wait for
  # a kubelet that is gone (the pod garbage collector removes them; Deployments make new ones).
  if [ $any = 1 ] && control_plane_up; then
    kc delete node "$NODE_NAME" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
  restore_sysctls
  # Runtime state goes; containerd's root (imported images) and the logs stay.
  if [ -d "$NODE" ]; then
    case "$(findmnt -rn -o TARGET)" in *"$NODE/"*) die "mounts under $NODE remain (findmnt | grep $NODE); unmount them and rerun" ;; esac
    rm -rf --one-file-system "$NODE/containerd/state" "$NODE/kubelet" "$NODE/cni/ipam"
  fi
  # The kubelet always makes /var/lib/kubelet/device-plugins (a fixed path); the shims use
  # /run/containerd/s. Remove what we made.
  if [ -f "$NODE/made-var-lib-kubelet" ]; then
    rm -rf --one-file-system /var/lib/kubelet && rm -f "$NODE/made-var-lib-kubelet"
  fi
  # A killed shim leaves its socket behind: remove the sockets nobody listens on any more.
  local listening f
  listening=$(ss -xlH 2>/dev/null || true)
  for f in /run/containerd/s/*; do
    [ -S "$f" ] || continue
    case "$listening" in *"$f "*) ;; *) rm -f "$f" ;; esac
  done
  rmdir /run/containerd/s /run/containerd 2>/dev/null || true
  [ $any = 1 ] && log "node stopped (logs kept in $DIR/logs; pod logs in /var/log/pods)"
  return 0
}

# ------------------------------------------------------------------------------------ up

client_cert() { # NAME CN [O]: a client certificate signed by the cluster CA, and a kubeconfig
  local name="$1" cn="$2" org="${3:-}" p="$NODE/pki"
  local subj="/CN=$cn"
  [ -n "$org" ] && subj="/O=$org/CN=$cn"
  openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$p/$name.key" -out "$p/$name.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$p/client.ext"
  openssl x509 -req -in "$p/$name.csr" -CA "$DIR/pki/ca.crt" -CAkey "$DIR/pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$p/client.ext" -out "$p/$name.crt" 2>/dev/null
  cat >"$NODE/$name.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$DIR/pki/ca.crt"}
users:
- name: $name
  user: {client-certificate: "$p/$name.crt", client-key: "$p/$name.key"}
contexts:
- name: local
  context: {cluster: local, user: $name}
current-context: local
KC
  chmod 600 "$NODE/$name.kubeconfig" "$p/$name.key"
}

pause_image() {
  [ -f "$PAUSE_TAR" ] && return 0
  local src
  if [ "$FL_K8S_VERSION" = "$FL_K8S_LEGACY_VERSION" ]; then
    src="$FL_CACHE/k8s-$FL_K8S_VERSION/src/kubernetes/build/pause/linux/pause.c"
  else
    src="$(go env GOMODCACHE)/k8s.io/kubernetes@v$FL_K8S_VERSION/build/pause/linux/pause.c"
  fi
  [ -f "$src" ] || die "no $src: the Kubernetes source is missing (rm -rf $FL_CACHE/k8s-$FL_K8S_VERSION/bin and rerun hack/k8s-binaries.sh --node to fetch and rebuild it)"
  log "building the pause image from $src (gcc -static)"
  local work
  work=$(mktemp -d)
  mkdir -p "$work/rootfs" "$(dirname "$PAUSE_TAR")"
  gcc -Os -Wall -Werror -static -DVERSION="v3.4-k8s-$FL_K8S_VERSION" -o "$work/rootfs/pause" "$src"
  strip "$work/rootfs/pause"
  chmod 0755 "$work/rootfs/pause"
  docker_archive "$PAUSE_TAR" "$PAUSE_IMAGE" "$work/rootfs" "65535:65535" /pause >/dev/null
  rm -rf "$work"
}

containerd_config() {
  mkdir -p "$NODE/containerd/root" "$NODE/containerd/state" "$NODE/cni/net.d" "$NODE/cni/ipam"
  chmod 711 "$NODE/containerd/root" "$NODE/containerd/state"
  cat >"$NODE/containerd/config.toml" <<TOML
# Written by hack/node.sh: a containerd of our own, nothing under /etc or /var/lib/containerd.
version = 2
root = "$NODE/containerd/root"
state = "$NODE/containerd/state"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[debug]
  level = "info"
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "$NODE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # Raises the kubelet's negative OOM score adjustments to 0 (see the script).
        BinaryName = "$WRAPPER"
        Root = "$NODE/containerd/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".registry]
    # hosts.toml per registry host; the test bed's registry (hack/registry.sh) is plain HTTP.
    config_path = "$NODE/containerd/certs.d"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$NODE/cni/net.d"
    max_conf_num = 1
TOML
  mkdir -p "$NODE/containerd/certs.d/$FL_REGISTRY"
  cat >"$NODE/containerd/certs.d/$FL_REGISTRY/hosts.toml" <<TOML
# Written by hack/node.sh: the test bed's registry (hack/registry.sh) speaks plain HTTP.
server = "http://$FL_REGISTRY"
[host."http://$FL_REGISTRY"]
  capabilities = ["pull", "resolve"]
TOML
}

network_up() {
  local svc_ip
  svc_ip=$(kc get service kubernetes -n default -o 'jsonpath={.spec.clusterIP}') || true
  [ -n "$svc_ip" ] || die "cannot read the ClusterIP of Service default/kubernetes"
  mkdir -p "$NODE/cni/net.d" "$NODE/cni/ipam"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # Let packets from pods that the NAT rule sends to 127.0.0.1 in and their answers out.
  echo 1 >"/proc/sys/net/ipv4/conf/$BRIDGE/route_localnet"
  iptables -t nat -N "$NAT_CHAIN"
  iptables -t nat -A "$NAT_CHAIN" -d "$svc_ip/32" -p tcp --dport 443 -j DNAT --to-destination "127.0.0.1:$API_PORT" \
    -m comment --comment "fencedlease node: pods reach the API server through Service default/kubernetes"
  iptables -t nat -A PREROUTING -i "$BRIDGE" -j "$NAT_CHAIN"
  # isGateway=false and no ipMasq: the bridge plugin neither turns on IP forwarding nor
  # touches iptables. Routes: the bridge subnet, and the kubernetes Service IP via the node.
  cat >"$NODE/cni/net.d/10-fencedlease.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "fencedlease-node",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$NODE/cni/ipam",
        "ranges": [[{"subnet": "$SUBNET.0/24", "rangeStart": "$SUBNET.2", "rangeEnd": "$SUBNET.254"}]],
        "routes": [{"dst": "$svc_ip/32", "gw": "$NODE_IP"}]
      }
    }
  ]
}
JSON
}

kubelet_config() {
  mkdir -p "$NODE/kubelet" "$NODE/kubelet-pki" "$NODE/kubelet-plugins"
  cat >"$NODE/kubelet-config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
cgroupDriver: cgroupfs
failSwapOn: false
oomScoreAdj: 0
# No KUBE-FIREWALL/KUBE-MARK-*/canary chains in the host's iptables: nothing here needs them.
makeIPTablesUtilChains: false
# Only the API server's clients with certificates from the cluster CA, or tokens it vouches
# for, may use the kubelet API; what they may do is asked of the API server (RBAC).
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true, cacheTTL: 2m0s}
  x509: {clientCAFile: "$DIR/pki/ca.crt"}
authorization:
  mode: Webhook
  webhook: {cacheAuthorizedTTL: 5m0s, cacheUnauthorizedTTL: 30s}
volumePluginDir: "$NODE/kubelet-plugins"
# A build machine's disk is shared and often fuller than a node's: evict only when nearly
# full, and never garbage-collect images (they were imported; nothing can pull them again).
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
YAML
  if [ "$MINOR" -ge 27 ]; then
    cat >>"$NODE/kubelet-config.yaml" <<YAML
containerRuntimeEndpoint: "unix://$SOCK"
imageServiceEndpoint: "unix://$SOCK"
runtimeRequestTimeout: 5m0s
YAML
  fi
  # cgroup v1 here (see the top of this file); 1.35+ refuses it unless told otherwise.
  [ "$MINOR" -lt 35 ] || echo "failCgroupV1: false" >>"$NODE/kubelet-config.yaml"
}

# check_skew: the kubelet ($MINOR) may be up to three minors older than the API server, never newer.
check_skew() {
  local api
  api=$(kc version -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["minor"].rstrip("+"))') ||
    die "cannot read the API server's version (kubectl version) on 127.0.0.1:$API_PORT"
  if [ "$MINOR" -gt "$api" ] || [ "$MINOR" -lt $((api - 3)) ]; then
    die "kubelet v1.$MINOR (FL_K8S_VERSION=$FL_K8S_VERSION) is outside the skew policy of the API server v1.$api (a kubelet may be up to three minors older, never newer): start both with the same FL_K8S_VERSION (hack/cluster.sh down && hack/cluster.sh up)"
  fi
}

up() {
  control_plane_up ||
    die "no control plane answers on 127.0.0.1:$API_PORT with $ADMIN_KUBECONFIG: start it first with hack/cluster.sh up (same FENCEDLEASE_CLUSTER_DIR and FL_* ports)"
  if healthy; then
    log "node $NODE_NAME already running and Ready"
    return 0
  fi
  down
  [ "$(id -u)" = 0 ] || die "the node needs root (containerd, kubelet, network namespaces)"
  apt_install containerd runc containernetworking-plugins iptables gcc libc6-dev
  local bins
  bins=$("$FL_REPO/hack/k8s-binaries.sh" --node)
  MINOR=$(binary_minor "$bins/kubelet")
  check_skew
  for port in "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" "$SCHED_PORT"; do
    port_free "$port" || die "port $port on this machine is taken (ss -ltnp 'sport = :$port'); stop that program or set FL_KUBELET_PORT / FL_KUBELET_HEALTHZ_PORT / FL_SCHEDULER_PORT"
  done
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || die "a network interface $BRIDGE exists already (another node?); set FL_NODE_BRIDGE and FL_NODE_SUBNET"
  [ -z "$(live_kubelets)" ] || die "another kubelet runs on this machine (pgrep -a kubelet); one node per machine"
  mkdir -p "$NODE/pids" "$NODE/pki" "$DIR/logs"
  # A failed start leaves nothing running behind (the logs stay).
  trap 'log "start failed: stopping what was started"; down' EXIT

  log "certificates for $NODE_NAME (system:node) and kube-scheduler, signed by the cluster CA"
  client_cert kubelet "system:node:$NODE_NAME" system:nodes
  client_cert kube-scheduler system:kube-scheduler
  # Without the Node authorizer, the node role is granted through RBAC.
  kc apply -f - >/dev/null <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "fencedlease-local:nodes"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
YAML

  log "network: bridge $BRIDGE ($NODE_IP/24), NAT to the API server for pods"
  network_up
  pause_image
  containerd_config

  log "starting containerd (socket $SOCK)"
  start containerd env FL_RUNC_WRAPPER_LOG="$DIR/logs/runc-wrapper.log" containerd --config "$NODE/containerd/config.toml"
  wait_for containerd 60 "$DIR/logs/containerd.log" "$NODE/pids/containerd" "$RETRY" node_containerd_running
  node_has_image "$PAUSE_IMAGE" || import_archive "$PAUSE_TAR" "$PAUSE_IMAGE"

  log "starting kube-scheduler on 127.0.0.1:$SCHED_PORT"
  # In 1.20 --port defaults to an open HTTP port (10251); 0 turns it off. Gone by 1.24.
  local sched_version_flags=()
  [ "$MINOR" -ge 24 ] || sched_version_flags+=(--port=0)
  mkdir -p "$NODE/kube-scheduler"
  start kube-scheduler "$bins/kube-scheduler" --kubeconfig="$NODE/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig="$NODE/kube-scheduler.kubeconfig" --authorization-kubeconfig="$NODE/kube-scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false \
    --cert-dir="$NODE/kube-scheduler" "${sched_version_flags[@]}"

  if [ ! -f "$NODE/sysctl.saved" ]; then
    for k in "${SYSCTLS[@]}"; do echo "$k $(cat "/proc/sys/$k")"; done >"$NODE/sysctl.saved"
  fi
  kubelet_config
  [ -e /var/lib/kubelet ] || touch "$NODE/made-var-lib-kubelet"
  log "starting kubelet v$FL_K8S_VERSION as node $NODE_NAME ($NODE_IP; API on 127.0.0.1:$KUBELET_PORT)"
  # Before 1.27 the runtime is chosen by flags; from then on by the configuration (kubelet_config).
  local kubelet_version_flags=()
  [ "$MINOR" -ge 27 ] || kubelet_version_flags+=(--container-runtime=remote
    --container-runtime-endpoint="unix://$SOCK" --image-service-endpoint="unix://$SOCK"
    --runtime-request-timeout=5m --pod-infra-container-image="$PAUSE_IMAGE")
  start kubelet "$bins/kubelet" --config="$NODE/kubelet-config.yaml" --kubeconfig="$NODE/kubelet.kubeconfig" \
    --root-dir="$NODE/kubelet" --cert-dir="$NODE/kubelet-pki" "${kubelet_version_flags[@]}" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --v=1

  wait_for kube-scheduler 60 "$DIR/logs/kube-scheduler.log" "$NODE/pids/kube-scheduler" "$RETRY" curl -fsSk --max-time 2 "https://127.0.0.1:$SCHED_PORT/healthz"
  wait_for kubelet 60 "$DIR/logs/kubelet.log" "$NODE/pids/kubelet" "$RETRY" curl -fsS --max-time 2 "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz"
  wait_for "node $NODE_NAME" 180 "$DIR/logs/kubelet.log" "$NODE/pids/kubelet" "$RETRY" node_ready
  kc annotate node "$NODE_NAME" --overwrite "fencedlease.io/containerd-socket=$SOCK" >/dev/null
  trap - EXIT
  log "node $NODE_NAME is Ready: pods run here (logs: $DIR/logs; pod logs: /var/log/pods)"
}

status() {
  local c rc=0
  for c in containerd kubelet kube-scheduler; do
    if pid_alive "$c"; then echo "$c: running (pid $(cat "$NODE/pids/$c"))"; else echo "$c: not running"; rc=1; fi
  done
  if ! control_plane_up; then
    echo "control plane: not answering on 127.0.0.1:$API_PORT (hack/cluster.sh up)"; rc=1
  elif node_ready; then
    echo "node $NODE_NAME: Ready ($NODE_IP)"
  else
    echo "node $NODE_NAME: not Ready"; rc=1
  fi
  [ $rc = 0 ] || echo "start it with: hack/node.sh up"
  return $rc
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
