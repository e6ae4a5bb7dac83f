#!/usr/bin/env bash
# Builds one of the release tools from its Go module, once, and prints the binary's path.
#
#   hack/gotool.sh registry                 -> ~/.cache/fencedlease/tools/registry-v3.1.2/registry
#   "$(hack/gotool.sh cosign)" version
#   hack/gotool.sh all                      build every tool (CI does, with progress)
#
# The tools, each pinned here and nowhere else:
#   registry                CNCF distribution's OCI registry (the test bed's, hack/registry.sh)
#   cosign                  signs and verifies images and the chart (hack/release.sh)
#   crane                   pushes the OCI images hack/image.sh writes, reads digests
#   validate-krew-manifest  krew's own check of the plugin manifest hack/release.sh writes
#   krew                    what that check installs the plugin with (as `kubectl krew`)
#   actionlint              lints .github/workflows/ (the release workflow)
#
# Each comes from the Go module proxy with `go install MODULE/cmd/X@VERSION` into
# $FENCEDLEASE_CACHE/tools/NAME-VERSION/ (default ~/.cache/fencedlease), so later runs take a
# moment. Module downloads land in Go's own cache (~/go/pkg/mod). Cold, cosign takes the longest
# (several minutes on 2 cores).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

# name -> "package@version"
tool_package() {
  case "$1" in
    registry) echo github.com/distribution/distribution/v3/cmd/registry@v3.1.2 ;;
    cosign) echo github.com/sigstore/cosign/v2/cmd/cosign@v2.6.5 ;;
    crane) echo github.com/google/go-containerregistry/cmd/crane@v0.22.1 ;;
    validate-krew-manifest) echo sigs.k8s.io/krew/cmd/validate-krew-manifest@v0.4.3 ;;
    krew) echo sigs.k8s.io/krew/cmd/krew@v0.4.3 ;;
    actionlint) echo github.com/rhysd/actionlint/cmd/actionlint@v1.7.12 ;;
    *) return 1 ;;
  esac
}
ALL=(registry crane cosign validate-krew-manifest krew actionlint)

# build NAME: prints the binary's path, building it first when missing.
build() {
  local name="$1" pkg version dir bin
  pkg=$(tool_package "$name") || die "unknown tool '$name'; known: ${ALL[*]} (or all)"
  version="${pkg##*@}"
  dir="$FL_CACHE/tools/$name-$version"
  bin="$dir/$name"
  if [ ! -x "$bin" ]; then
    command -v go >/dev/null || die "go not found: install Go 1.24 or later (Debian: golang), then rerun"
    mkdir -p "$dir" || die "cannot create $dir: set FENCEDLEASE_CACHE to a writable folder"
    exec 9>"$dir/.build.lock"
    flock 9
    if [ ! -x "$bin" ]; then
      log "building $name $version from the Go module proxy (once; log: $dir/build.log)"
      rm -rf "$dir/bin.new"
      with_heartbeat "go install $pkg" "$dir/build.log" \
        env GOBIN="$dir/bin.new" CGO_ENABLED=0 GOFLAGS=-buildvcs=false go install "$pkg"
      [ -x "$dir/bin.new/$name" ] || die "go install $pkg wrote no $name (log: $dir/build.log)"
      mv "$dir/bin.new/$name" "$bin"
      rmdir "$dir/bin.new"
    fi
    exec 9>&-
  fi
  echo "$bin"
}

case "${1:-}" in
  all) for t in "${ALL[@]}"; do build "$t" >/dev/null; done; log "release tools ready in $FL_CACHE/tools" ;;
  "") die "usage: $0 TOOL|all (tools: ${ALL[*]})" ;;
  *) build "$1" ;;
esac
