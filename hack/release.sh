#!/usr/bin/env bash
# Releases fencedlease to an OCI registry: both images, the chart, their signatures and SBOMs.
#
#   hack/release.sh --registry HOST:PORT[/PATH] [--version V] [--plain-http] [--key FILE]
#
#   --registry   where to push. Images go to REGISTRY/fencedlease and REGISTRY/fencedlease-sidecar,
#                the chart to REGISTRY/charts/fencedlease (so `helm install fencedlease
#                oci://REGISTRY/charts/fencedlease --version V`). A TLS registry is the default:
#                log in first (`crane auth login`, `helm registry login`; cosign reads the same
#                ~/.docker/config.json), and a private CA goes in the system's trust store.
#   --plain-http the registry speaks plain HTTP (the test bed's on loopback, hack/registry.sh).
#   --force      replace a version already in the registry (refused otherwise).
#   --version    semantic version of the release (default: Cargo.toml's). Images are tagged V,
#                the chart's version and appVersion become V.
#   --source REF release an earlier commit or tag of this repository (its binaries, chart and
#                CRD) with today's scripts: the upgrade tests' previous release. Its sources are
#                unpacked with `git archive` into target/release-src/COMMIT and built once into
#                $FENCEDLEASE_CACHE/release-build/COMMIT (FL_IMAGE_PROFILE's profile).
#   --plugin-url-base URL
#                where the release's downloads are published (default: the GitHub releases of
#                fencedlease/fencedlease); the krew manifest points at URL/vV/ARCHIVE.
#   --key        cosign private key (COSIGN_PASSWORD holds its password). Default: the test bed's
#                key pair, made once in $FENCEDLEASE_CACHE/test-bed-key with an empty password;
#                it signs nothing anyone should trust outside the test bed.
#
# Steps, each printed: build the two images as OCI layouts (hack/image.sh; FL_IMAGE_PROFILE=debug
# packages the test build, as CI does), push them (crane), write a CycloneDX SBOM for each
# (hack/sbom.py) and attach it as a signed attestation (cosign attest --type cyclonedx), sign each
# image by digest (cosign sign), write the chart with the images pinned by digest, package and
# push it (helm push), sign it by digest with its version as a signed annotation. What is
# signed is always the digest of what was built here. The chart's tag comes last, after the
# images are signed; until the chart is signed too, hack/verify-release.sh refuses the version
# (fail closed). No transparency log is used (--tlog-upload=false): verification rests on the
# public key alone (hack/verify-release.sh).
#
# Output: target/release/V/: digests.txt (one "KIND REF@DIGEST" line each, and "plugin FILE"),
# the chart package, the SBOMs, the kubectl plugin's archive and krew manifest, and cosign.pub
# (the public key to verify with). The same lines go to stdout.
# The release workflow (.github/workflows/release.yml) runs this script for a public registry.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

REGISTRY="" VERSION="" PLAIN_HTTP=0 KEY="" SOURCE="" FORCE=0
PLUGIN_URL_BASE=https://github.com/fencedlease/fencedlease/releases/download
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) REGISTRY="${2:?--registry needs HOST:PORT}"; shift 2 ;;
    --version) VERSION="${2:?--version needs a version}"; shift 2 ;;
    --plain-http) PLAIN_HTTP=1; shift ;;
    --force) FORCE=1; shift ;;
    --key) KEY="${2:?--key needs a file}"; shift 2 ;;
    --source) SOURCE="${2:?--source needs a commit or tag}"; shift 2 ;;
    --plugin-url-base) PLUGIN_URL_BASE="${2:?--plugin-url-base needs a URL}"; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see $0 --help)" ;;
  esac
done
[ -n "$REGISTRY" ] || die "--registry HOST:PORT is required (the test bed's: --registry $FL_REGISTRY --plain-http)"
VERSION="${VERSION:-$(fl_version)}"
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
  die "--version $VERSION is not a semantic version (MAJOR.MINOR.PATCH[-PRERELEASE]); helm and the tags need one"

# shellcheck source=hack/release-lib.sh
source "$(dirname "$0")/release-lib.sh"
# SRC: the tree whose chart and binaries are released; BINARY_operator/BINARY_sidecar: prebuilt
# binaries (--source), or empty for hack/image.sh's own build of this tree.
SRC="$FL_REPO" BINARY_operator="" BINARY_sidecar=""
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$FL_REPO" log -1 --format=%ct)}"
if [ -n "$SOURCE" ]; then
  build_source "$SOURCE"
fi
OUT="$FL_REPO/target/release/$VERSION"
# A published version is never replaced silently: users and the lock files of GitOps tools
# pinned its digests.
if [ "$FORCE" = 0 ] && "$CRANE" digest "${CRANE_FLAGS[@]}" "$REGISTRY/charts/fencedlease:$VERSION" >/dev/null 2>&1; then
  die "$REGISTRY/charts/fencedlease:$VERSION exists already: release a new version, or pass --force to replace it (the test bed does)"
fi
rm -rf "$OUT"
mkdir -p "$OUT"
if [ -z "$KEY" ]; then
  KEY=$(test_bed_key)
  log "signing with the test bed's key $KEY (trusted by nobody outside the test bed)"
fi
[ -f "$KEY" ] || die "--key $KEY: no such file (make one with: cosign generate-key-pair)"
export COSIGN_PASSWORD="${COSIGN_PASSWORD:-}"
"$COSIGN" public-key --key "$KEY" >"$OUT/cosign.pub" ||
  die "cosign cannot read the key $KEY: wrong COSIGN_PASSWORD?"

: >"$OUT/digests.txt"
record() { echo "$1 $2" | tee -a "$OUT/digests.txt"; }

# push_image ROLE NAME: build, push, SBOM, sign; sets IMAGE_DIGEST.
push_image() {
  local role="$1" name="$2" ref binary digest
  log "image $name: building its OCI layout (hack/image.sh)"
  if [ "$role" = sidecar ]; then binary="$BINARY_sidecar"; else binary="$BINARY_operator"; fi
  FL_IMAGE_BINARY="$binary" FL_IMAGE_VERSION="$VERSION" FL_IMAGE_IMPORT=0 FL_IMAGE_ROLE="$role" "$FL_REPO/hack/image.sh"
  binary="${binary:-$(image_binary "$role")}"
  ref="$REGISTRY/$name"
  log "image $name: pushing to $ref:$VERSION"
  # The digest signed is the one built here (the layout's manifest), never what the registry
  # says the tag points to afterwards.
  digest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' \
    "$FL_REPO/target/image/$name-$VERSION.oci/index.json")
  "$CRANE" push "${CRANE_FLAGS[@]}" "$FL_REPO/target/image/$name-$VERSION.oci" "$ref:$VERSION" >/dev/null ||
    die "crane push to $ref:$VERSION failed: is the registry up and are you logged in? (plain HTTP needs --plain-http)"
  [ "$("$CRANE" digest "${CRANE_FLAGS[@]}" "$ref@$digest")" = "$digest" ] ||
    die "the registry does not serve $ref@$digest after the push"
  log "image $name: SBOM (CycloneDX) and its signed attestation"
  python3 "$FL_REPO/hack/sbom.py" --role "$role" --version "$VERSION" --binary "$binary" --source "$SRC" >"$OUT/$name.cdx.json"
  "$COSIGN" attest "${COSIGN_FLAGS[@]}" --key "$KEY" --type cyclonedx --predicate "$OUT/$name.cdx.json" \
    "$ref@$digest" >>"$OUT/cosign.log" 2>&1 || die "cosign attest $ref@$digest failed (log: $OUT/cosign.log)"
  log "image $name: signing $digest"
  "$COSIGN" sign "${COSIGN_FLAGS[@]}" --key "$KEY" "$ref@$digest" >>"$OUT/cosign.log" 2>&1 ||
    die "cosign sign $ref@$digest failed (log: $OUT/cosign.log)"
  record image "$ref@$digest"
  IMAGE_DIGEST="$digest"
}

push_image operator fencedlease
OPERATOR_DIGEST="$IMAGE_DIGEST"
push_image sidecar fencedlease-sidecar
SIDECAR_DIGEST="$IMAGE_DIGEST"

log "chart: pinning both images by digest, packaging"
chart_dir="$OUT/chart/fencedlease"
mkdir -p "$OUT/chart"
cp -r "$SRC/charts/fencedlease" "$chart_dir"
fingerprint=$(openssl pkey -pubin -in "$OUT/cosign.pub" -outform DER | sha256sum | cut -d' ' -f1)
pin_chart "$chart_dir" "$VERSION" "$REGISTRY/fencedlease" "$OPERATOR_DIGEST" "$REGISTRY/fencedlease-sidecar" "$SIDECAR_DIGEST" "$fingerprint"
"$HELM" package "$chart_dir" --destination "$OUT" >/dev/null
package="$OUT/fencedlease-$VERSION.tgz"
check_pinned "$package" "$REGISTRY/fencedlease@$OPERATOR_DIGEST" "$REGISTRY/fencedlease-sidecar@$SIDECAR_DIGEST"
log "chart: pushing to oci://$REGISTRY/charts"
"$HELM" push "$package" "oci://$REGISTRY/charts" "${HELM_FLAGS[@]}" >"$OUT/helm-push.log" 2>&1 ||
  die "helm push failed (log: $OUT/helm-push.log)"
chart_ref="$REGISTRY/charts/fencedlease"
# The digest helm pushed, and its chart layer must be the package built here: what is signed
# is this package, whatever the tag points to meanwhile.
chart_digest=$(sed -n 's/^Digest: \(sha256:[0-9a-f]\{64\}\)$/\1/p' "$OUT/helm-push.log")
[ -n "$chart_digest" ] || die "helm push printed no digest (log: $OUT/helm-push.log)"
[ "$(chart_layer "$chart_ref@$chart_digest")" = "sha256:$(sha256sum "$package" | cut -d' ' -f1)" ] ||
  die "the chart at $chart_ref@$chart_digest is not the package built here ($package)"
log "chart: signing $chart_digest"
# The version goes into the signature too (-a version=V), so that a chart signed for another
# version, moved under this tag, is refused (hack/verify-release.sh checks both).
"$COSIGN" sign "${COSIGN_FLAGS[@]}" --key "$KEY" -a "version=$VERSION" "$chart_ref@$chart_digest" >>"$OUT/cosign.log" 2>&1 ||
  die "cosign sign $chart_ref@$chart_digest failed (log: $OUT/cosign.log)"
record chart "$chart_ref@$chart_digest"
rm -rf "$OUT/chart"

# The kubectl plugin for krew: its archive (for the release's downloads) and manifest (for
# krew-index), with the archive's checksum.
plugin="fencedlease-v$VERSION-linux-amd64.tar.gz"
plugin_archive "$OUT/$plugin" "${BINARY_operator:-$(image_binary operator)}"
krew_manifest "$VERSION" "$PLUGIN_URL_BASE/v$VERSION/$plugin" "$(sha256sum "$OUT/$plugin" | cut -d' ' -f1)" >"$OUT/fencedlease.krew.yaml"
record plugin "$OUT/$plugin"
log "released $VERSION to $REGISTRY; digests in $OUT/digests.txt; verify with:"
log "  hack/verify-release.sh --registry $REGISTRY --version $VERSION --key $OUT/cosign.pub$([ "$PLAIN_HTTP" = 1 ] && echo ' --plain-http')"
