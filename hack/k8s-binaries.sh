#!/usr/bin/env bash
# Makes sure the Kubernetes binaries the local cluster needs exist, and prints their folder.
#
#   hack/k8s-binaries.sh [--node] [VERSION]
#       etcd, kube-apiserver, kube-controller-manager; with --node also kube-scheduler and
#       kubelet. VERSION (or $FL_K8S_VERSION) defaults to $FL_K8S_DEFAULT_VERSION (hack/lib.sh),
#       the newest release that builds and runs here; 1.20.2 is the oldest one we support.
#
# Where they come from, in this order:
#   1. $KUBEBUILDER_ASSETS (the setup-envtest layout: etcd, kube-apiserver, kubectl), for
#      users on other systems who bring their own binaries (any version: hack/cluster.sh asks
#      the binary which one it is);
#   2. the cache outside the repository ($FENCEDLEASE_CACHE, default ~/.cache/fencedlease),
#      one folder per version: k8s-VERSION/bin;
#   3. built here, then cached:
#      - 1.20.2: from Debian's `kubernetes` source package, with the vendored reflect2 replaced by
#        Debian's v1.0.2 (the vendored v1.0.1 crashes under Go >= 1.18 the first time the API
#        server decodes a custom resource), with Debian's Go 1.19 (the tree breaks under newer
#        Go) and Debian's etcd 3.4;
#      - any other version: from the Go modules. k8s.io/kubernetes requires its staging modules
#        (k8s.io/api, k8s.io/client-go, ...) as v0.0.0 and points them at ./staging, which a
#        module that depends on it cannot see; so we generate a small module in the cache that
#        requires k8s.io/kubernetes vVERSION and replaces each staging module with its
#        published v0.MINOR.PATCH, and `go build` the commands from it. etcd comes from
#        go.etcd.io/etcd/server/v3 at the version k8s.io/kubernetes's own go.mod names (the one
#        that release is tested with), in a second module, so that Kubernetes' dependency
#        versions do not leak into etcd's build. Uses the Go on PATH (1.26 builds 1.37.2); if
#        a release needs a newer one: export GOTOOLCHAIN=go1.27.3.
# Version strings are stamped in as Kubernetes' own build does (-X .../version.gitVersion=...):
# clients, and the project's code, choose behaviour by the server's /version.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

want=(kube-apiserver kube-controller-manager)
version="$FL_K8S_VERSION"
for arg in "$@"; do
  case "$arg" in
    --node) want+=(kube-scheduler kubelet) ;;
    [0-9]*.[0-9]*.[0-9]*) version="$arg" ;;
    *) die "usage: $0 [--node] [VERSION]   (VERSION like $FL_K8S_DEFAULT_VERSION or $FL_K8S_LEGACY_VERSION; got '$arg')" ;;
  esac
done

root="$FL_CACHE/k8s-$version"
bin="$root/bin"

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

# One build per version at a time: two clusters starting cold would otherwise both build into
# the same folder.
mkdir -p "$root"
exec 9>"$root/.build.lock"
if ! flock -n 9; then
  log "another build of Kubernetes v$version is running (lock: $root/.build.lock); waiting for it"
  flock 9
  if has_all "$bin" etcd "${want[@]}"; then echo "$bin"; exit 0; fi
fi

# build_1_20 NAME...: Kubernetes v1.20.2 from Debian's source package, into $bin.
build_1_20() {
  [ -f /etc/debian_version ] ||
    die "no Kubernetes binaries in $bin and this is not Debian: set KUBEBUILDER_ASSETS to a folder with etcd and kube-apiserver (setup-envtest use)"

  log "building Kubernetes v$version from Debian's source package (cold: about 5-10 minutes on 2 cores; cached afterwards in $bin)"
  apt_install rsync etcd-server dpkg-dev golang-github-modern-go-reflect2-dev

  local src_root="$root/src"
  local tree="$src_root/kubernetes"
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
    local dsc
    dsc=$(ls "$src_root"/kubernetes_*.dsc | head -n1)
    (cd "$src_root" && with_heartbeat "unpack source" "$src_root/unpack.log" dpkg-source -x "$dsc" kubernetes)
    local r2="$tree/vendor/github.com/modern-go/reflect2"
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
  local targets=()
  for b in "$@"; do targets+=("cmd/$b"); done
  (
    cd "$tree/.go/src/k8s.io/kubernetes"
    export GOPATH="$tree/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS=
    with_heartbeat "go build ${targets[*]}" "$src_root/build.log" make WHAT="${targets[*]}"
  )
  mkdir -p "$bin"
  for b in "$@"; do install -m 0755 "$tree/_output/local/bin/linux/amd64/$b" "$bin/$b"; done
  ln -sfn /usr/bin/etcd "$bin/etcd"
}

# build_from_modules NAME...: Kubernetes v$version and its etcd from the Go module proxy, into $bin.
build_from_modules() {
  command -v go >/dev/null ||
    die "no go on PATH: install Go >= 1.26 (or set KUBEBUILDER_ASSETS, or FL_K8S_VERSION=$FL_K8S_LEGACY_VERSION for Debian's build)"
  local minor="${version#*.}"; minor="${minor%%.*}"
  local patch="${version##*.}"
  local staging_version="v0.$minor.$patch"
  local kmod="$root/mod-kubernetes" emod="$root/mod-etcd" logs="$root/logs"
  mkdir -p "$kmod" "$emod" "$logs" "$bin"
  # GOFLAGS from the environment (say -mod=vendor) must not change how these modules resolve;
  # -trimpath keeps the cache's paths out of the binaries.
  export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -trimpath" GO111MODULE=on
  log "building Kubernetes v$version from the Go modules with $(go version | cut -d' ' -f3) (cold: about 120 MB of modules, then about 6 minutes on 2 cores, 4 of them for kube-apiserver; cached afterwards in $bin)"

  # Kubernetes' go.mod tells which staging modules to replace and which etcd it is tested with.
  local kgomod
  (cd "$kmod" && with_heartbeat "download k8s.io/kubernetes@v$version" "$logs/download-kubernetes.log" \
    go mod download -json "k8s.io/kubernetes@v$version") ||
    die "k8s.io/kubernetes v$version is not available from the Go module proxy (see $logs/download-kubernetes.log); pick a served version: go list -m -versions k8s.io/kubernetes"
  kgomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' "$logs/download-kubernetes.log")
  [ -f "$kgomod" ] || die "could not find k8s.io/kubernetes v$version's go.mod (see $logs/download-kubernetes.log)"
  local staging
  staging=$(sed -n 's|^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*|\1|p' "$kgomod")
  [ -n "$staging" ] || die "k8s.io/kubernetes v$version's go.mod ($kgomod) has no ./staging replacements: this script expects the 1.2x/1.3x layout"
  local etcd_version
  etcd_version=$(awk '$1 == "go.etcd.io/etcd/server/v3" { print $2; exit }' "$kgomod")
  [ -n "$etcd_version" ] || etcd_version=$(awk '$1 == "go.etcd.io/etcd/client/v3" { print $2; exit }' "$kgomod")
  [ -n "$etcd_version" ] || die "cannot tell which etcd k8s.io/kubernetes v$version uses (no go.etcd.io/etcd/{server,client}/v3 in $kgomod)"

  {
    echo "// Generated by hack/k8s-binaries.sh: builds Kubernetes v$version's commands."
    echo "module fencedlease.local/k8s-build"
    echo
    echo "go $(awk '$1 == "go" { print $2; exit }' "$kgomod")"
    echo
    echo "require k8s.io/kubernetes v$version"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $staging_version"; done
    echo ")"
  } >"$kmod/go.mod.new"
  # `go get` below adds to go.mod; start over only when what we generate changes.
  if ! cmp -s "$kmod/go.mod.new" "$kmod/go.mod.generated" || [ ! -f "$kmod/go.mod" ]; then
    cp "$kmod/go.mod.new" "$kmod/go.mod"
    mv "$kmod/go.mod.new" "$kmod/go.mod.generated"
    rm -f "$kmod/go.sum"
  fi
  {
    echo "// Generated by hack/k8s-binaries.sh: builds the etcd Kubernetes v$version is tested with."
    echo "module fencedlease.local/etcd-build"
    echo
    echo "go $(awk '$1 == "go" { print $2; exit }' "$kgomod")"
    echo
    echo "require go.etcd.io/etcd/server/v3 $etcd_version"
  } >"$emod/go.mod"

  # `go get PKG@VERSION` pulls in exactly the modules those packages need and records their
  # checksums (verified against the checksum database) in go.sum.
  local pkgs=()
  for b in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$b@v$version"); done
  (cd "$kmod" && with_heartbeat "resolve modules for ${*}" "$logs/get-kubernetes.log" go get "${pkgs[@]}") ||
    die "resolving Kubernetes v$version's modules failed; if it says a newer Go is required: export GOTOOLCHAIN=go1.27.3 and rerun"
  if [ ! -x "$bin/etcd" ]; then
    (cd "$emod" && with_heartbeat "resolve modules for etcd $etcd_version" "$logs/get-etcd.log" \
      go get "go.etcd.io/etcd/server/v3@$etcd_version")
  fi

  # -s -w: no symbol tables or DWARF, as Kubernetes' release builds (halves the binaries).
  local date ldflags="-s -w"
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $pkg.gitVersion=v$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  local total=$SECONDS
  for b in "$@"; do
    [ -x "$bin/$b" ] && continue
    (cd "$kmod" && with_heartbeat "go build $b v$version" "$logs/build-$b.log" \
      go build -ldflags="$ldflags" -o "$bin/.$b.partial" "k8s.io/kubernetes/cmd/$b")
    mv "$bin/.$b.partial" "$bin/$b"
  done
  if [ ! -x "$bin/etcd" ]; then
    local etcd_ldflags="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$etcd_version"
    (cd "$emod" && with_heartbeat "go build etcd $etcd_version" "$logs/build-etcd.log" \
      go build -ldflags="$etcd_ldflags" -o "$bin/.etcd.partial" go.etcd.io/etcd/server/v3)
    mv "$bin/.etcd.partial" "$bin/etcd"
  fi
  log "built in $((SECONDS - total)) s (per binary: $logs/build-*.log and the lines above)"
}

if [ "$version" = "$FL_K8S_LEGACY_VERSION" ]; then
  build_1_20 "${want[@]}"
else
  build_from_modules "${want[@]}"
fi
has_all "$bin" etcd "${want[@]}" || die "build finished but $bin lacks some of: etcd ${want[*]}; remove $root and rerun"
log "Kubernetes v$version binaries ready in $bin"
echo "$bin"
