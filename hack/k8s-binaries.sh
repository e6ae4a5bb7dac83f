#!/usr/bin/env bash
# Makes sure the Kubernetes binaries the local cluster needs exist, and prints their folder.
#
#   hack/k8s-binaries.sh           etcd, kube-apiserver, kube-controller-manager
#   hack/k8s-binaries.sh --node    also kube-scheduler and kubelet
#
# Where they come from, in this order:
#   1. $KUBEBUILDER_ASSETS (the setup-envtest layout: etcd, kube-apiserver, kubectl), for
#      users on other systems who bring their own binaries;
#   2. the cache outside the repository ($FENCEDLEASE_CACHE, default ~/.cache/fencedlease);
#   3. on Debian: built from Debian's `kubernetes` source package (Kubernetes v1.20.2), with
#      the vendored reflect2 replaced by Debian's v1.0.2 (the vendored v1.0.1 crashes under
#      Go >= 1.18 the first time the API server decodes a custom resource), then cached.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

want=(kube-apiserver kube-controller-manager)
[ "${1:-}" = "--node" ] && want+=(kube-scheduler kubelet)

bin="$FL_CACHE/k8s-$FL_K8S_VERSION/bin"

has_all() { # DIR NAME...
  local dir="$1"; shift
  for b in "$@"; do [ -x "$dir/$b" ] || return 1; done
}

if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
  has_all "$KUBEBUILDER_ASSETS" etcd kube-apiserver ||
    die "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks etcd or kube-apiserver; unset it to build them here"
  has_all "$KUBEBUILDER_ASSETS" kube-controller-manager ||
    log "note: $KUBEBUILDER_ASSETS has no kube-controller-manager: namespaces will not finish deleting"
  echo "$KUBEBUILDER_ASSETS"
  exit 0
fi

if has_all "$bin" etcd "${want[@]}"; then
  echo "$bin"
  exit 0
fi

[ -f /etc/debian_version ] ||
  die "no Kubernetes binaries in $bin and this is not Debian: set KUBEBUILDER_ASSETS to a folder with etcd and kube-apiserver (setup-envtest use)"

log "building Kubernetes v$FL_K8S_VERSION from Debian's source package (cold: about 5-10 minutes on 2 cores; cached afterwards in $bin)"
apt_install rsync etcd-server dpkg-dev golang-github-modern-go-reflect2-dev

src_root="$FL_CACHE/k8s-$FL_K8S_VERSION/src"
tree="$src_root/kubernetes"
if [ ! -f "$tree/.fencedlease-patched" ]; then
  # apt-get source needs deb-src entries; the machine ships only deb ones. Mirror the
  # configured deb entries, whatever mirror they point at.
  if ! grep -rqs '^Types:.*deb-src\|^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    log "adding deb-src entries mirroring the configured deb ones"
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
        >/etc/apt/sources.list.d/fencedlease-deb-src.sources
    elif [ -f /etc/apt/sources.list ]; then
      sed -n 's/^deb /deb-src /p' /etc/apt/sources.list >/etc/apt/sources.list.d/fencedlease-deb-src.list
    else
      die "cannot find apt sources to mirror as deb-src; add a deb-src entry for bookworm main by hand"
    fi
    with_heartbeat "apt-get update (deb-src)" "$FL_CACHE/apt-update.log" apt-get update -q
  fi
  rm -rf "$src_root" && mkdir -p "$src_root"
  (cd "$src_root" && with_heartbeat "download kubernetes source package (34 MB)" "$src_root/download.log" \
    apt-get source --download-only kubernetes)
  dsc=$(ls "$src_root"/kubernetes_*.dsc | head -n1)
  (cd "$src_root" && with_heartbeat "unpack source" "$src_root/unpack.log" dpkg-source -x "$dsc" kubernetes)
  r2="$tree/vendor/github.com/modern-go/reflect2"
  [ -d "$r2" ] || die "unexpected source layout: $r2 missing"
  rm -f "$r2"/*.go "$r2"/*.s
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$r2/"
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$r2/" 2>/dev/null || true
  rm -f "$r2"/*_test.go
  touch "$tree/.fencedlease-patched"
  log "patched vendored reflect2 with Debian's v1.0.2"
fi

# GOPATH mode, as Debian's packaging builds it.
mkdir -p "$tree/.go/src/k8s.io"
ln -sfn ../../.. "$tree/.go/src/k8s.io/kubernetes"
use_go_for_k8s_1_20
targets=()
for b in "${want[@]}"; do targets+=("cmd/$b"); done
(
  cd "$tree/.go/src/k8s.io/kubernetes"
  export GOPATH="$tree/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS=
  with_heartbeat "go build ${targets[*]}" "$src_root/build.log" make WHAT="${targets[*]}"
)
mkdir -p "$bin"
for b in "${want[@]}"; do install -m 0755 "$tree/_output/local/bin/linux/amd64/$b" "$bin/$b"; done
ln -sfn /usr/bin/etcd "$bin/etcd"
log "Kubernetes binaries ready in $bin"
echo "$bin"
