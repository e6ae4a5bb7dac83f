#!/usr/bin/env bash
# Checks a release's signatures before anything of it is installed: the chart, every image the
# chart runs, and each image's SBOM attestation, all against one public key.
#
#   hack/verify-release.sh --registry HOST:PORT[/PATH] --version V --key cosign.pub [--plain-http]
#
# What it does:
#   1. resolves the chart's tag V to a digest and verifies the chart's signature on that digest,
#      made for version V (a signed annotation);
#   2. fetches the chart package through that digest (manifest, then the layer by its digest), so
#      the package read is the one signed, whatever the tag points to a moment later;
#   3. requires the package to say it is version V, renders it, requires every image (the
#      operator's, and the sidecar image the webhook injects) to be pinned by digest, then
#      verifies each image's signature and its CycloneDX SBOM attestation;
#   4. unpacks the package's CRD for `kubectl apply`.
# Any failure prints "REFUSED: ..." and exits 1. On success it prints "VERIFIED" and the commands
# that install exactly what was verified: the package it fetched (target/verified/V/
# fencedlease-V.tgz), or the chart by its digest (oci://...@sha256:...).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

REGISTRY="" VERSION="" PLAIN_HTTP=0 PUB=""
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) REGISTRY="${2:?--registry needs HOST:PORT}"; shift 2 ;;
    --version) VERSION="${2:?--version needs a version}"; shift 2 ;;
    --plain-http) PLAIN_HTTP=1; shift ;;
    --key) PUB="${2:?--key needs a public key file}"; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see $0 --help)" ;;
  esac
done
{ [ -n "$REGISTRY" ] && [ -n "$VERSION" ] && [ -n "$PUB" ]; } ||
  die "usage: $0 --registry HOST:PORT --version V --key cosign.pub [--plain-http]"
[ -f "$PUB" ] || die "--key $PUB: no such file (the release's public key, cosign.pub)"
# shellcheck source=hack/release-lib.sh
source "$(dirname "$0")/release-lib.sh"

refuse() { printf 'REFUSED: %s\n' "$*" >&2; exit 1; }
# cosign_error: cosign's own reason from its last log (its "Error:" line). Its warning that it
# cannot reach Sigstore's TUF repository is expected offline: the key is the only trust root.
cosign_error() { grep -m1 '^Error:' "$OUT/cosign.log" || tail -n1 "$OUT/cosign.log"; }
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
  die "--version $VERSION is not a semantic version (MAJOR.MINOR.PATCH[-PRERELEASE])"
OUT="$FL_REPO/target/verified/$VERSION"
rm -rf "$OUT"
mkdir -p "$OUT"

chart_ref="$REGISTRY/charts/fencedlease"
chart_digest=$("$CRANE" digest "${CRANE_FLAGS[@]}" "$chart_ref:$VERSION" 2>"$OUT/crane.log") ||
  refuse "no chart $chart_ref:$VERSION in the registry ($(tail -n1 "$OUT/crane.log"))"
log "chart $chart_ref:$VERSION is $chart_digest: verifying its signature for version $VERSION"
# -a version=V: the signature must be for this version (a chart signed for another version and
# moved under this tag, a rollback, is refused here and by the version check below).
"$COSIGN" verify "${COSIGN_VERIFY_FLAGS[@]}" --key "$PUB" -a "version=$VERSION" "$chart_ref@$chart_digest" >"$OUT/chart.sig.json" 2>"$OUT/cosign.log" ||
  refuse "the chart $chart_ref@$chart_digest has no valid signature by $PUB for version $VERSION ($(cosign_error))"

# The package through the signed digest: the manifest names the layer by digest, crane checks it.
layer=$(chart_layer "$chart_ref@$chart_digest") || refuse "the manifest of $chart_ref@$chart_digest has no Helm chart layer"
package="$OUT/fencedlease-$VERSION.tgz"
"$CRANE" blob "${CRANE_FLAGS[@]}" "$chart_ref@$layer" >"$package"
[ "sha256:$(sha256sum "$package" | cut -d' ' -f1)" = "$layer" ] || refuse "the chart package does not match its digest $layer"
meta=$("$HELM" show chart "$package")
{ grep -qx "version: $VERSION" <<<"$meta" && grep -qx "appVersion: \"\{0,1\}$VERSION\"\{0,1\}" <<<"$meta"; } ||
  refuse "the chart under $VERSION says it is $(sed -n 's/^version: //p' <<<"$meta") (appVersion $(sed -n 's/^appVersion: //p' <<<"$meta")): a chart of another version"

# Every image the chart runs, and the sidecar image its webhook injects (an argument).
images=$("$HELM" template fencedlease "$package" --namespace fencedlease-system --set injection.enabled=true | python3 -c '
import re, sys
lines = sys.stdin.read().splitlines()
found, sidecars = set(), set()
for i, line in enumerate(lines):
    m = re.match(r"^\s*(?:-\s+)?image:\s*\"?([^\"\s]+)\"?\s*$", line)
    if m:
        found.add(m.group(1))
    m = re.match(r"^\s*-\s+\"?--sidecar-image(?:=([^\"\s]+))?\"?\s*$", line)
    if m:
        nxt = re.match(r"^\s*-\s+\"?([^\"\s]+)\"?\s*$", lines[i + 1]) if i + 1 < len(lines) else None
        sidecars.add(m.group(1) or (nxt.group(1) if nxt else ""))
if not found or not sidecars or "" in sidecars:
    sys.exit("no image, or no --sidecar-image argument, in the rendered chart")
print("\n".join(sorted(found | sidecars)))') || refuse "the chart renders no image or no sidecar image to check"
for image in $images; do
  [[ "$image" == *@sha256:* ]] || refuse "the chart runs $image, not pinned by digest: a tag can be moved"
done
for image in $images; do
  log "image $image: verifying its signature and SBOM attestation"
  "$COSIGN" verify "${COSIGN_VERIFY_FLAGS[@]}" --key "$PUB" "$image" >>"$OUT/images.sig.json" 2>"$OUT/cosign.log" ||
    refuse "the image $image has no valid signature by $PUB ($(cosign_error))"
  "$COSIGN" verify-attestation "${COSIGN_VERIFY_FLAGS[@]}" --key "$PUB" --type cyclonedx "$image" >>"$OUT/images.att.json" 2>"$OUT/cosign.log" ||
    refuse "the image $image has no valid CycloneDX SBOM attestation by $PUB ($(cosign_error))"
done
# The CRD of the verified package, for `kubectl apply` before installing or upgrading.
tar -xzf "$package" -C "$OUT" fencedlease/crds
echo "VERIFIED $chart_ref@$chart_digest"
echo "the CRD first: kubectl apply --server-side -f $OUT/fencedlease/crds/"
echo "then install exactly this package: helm install fencedlease $package --namespace fencedlease-system --create-namespace"
echo "or the same chart by its digest: helm install fencedlease oci://$chart_ref@$chart_digest --namespace fencedlease-system --create-namespace$([ "$PLAIN_HTTP" = 1 ] && echo ' --plain-http')"
