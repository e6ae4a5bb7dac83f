# Shared by hack/release.sh and hack/verify-release.sh. Source it after hack/lib.sh, with
# PLAIN_HTTP (0 or 1) set; do not run it.
# shellcheck shell=bash
# Its variables are the callers' (CRANE, SRC, BINARY_*, SOURCE_DATE_EPOCH, ...).
# shellcheck disable=SC2034

CRANE=$("$FL_REPO/hack/gotool.sh" crane)
COSIGN=$("$FL_REPO/hack/gotool.sh" cosign)
HELM=$("$FL_REPO/hack/helm.sh")
# cosign: no transparency log (the test bed has none, and a key pair needs none); plain HTTP
# and a registry on loopback when asked. --yes: no prompts.
COSIGN_FLAGS=(--tlog-upload=false --yes)
CRANE_FLAGS=()
HELM_FLAGS=()
if [ "${PLAIN_HTTP:-0}" = 1 ]; then
  COSIGN_FLAGS+=(--allow-http-registry --allow-insecure-registry)
  CRANE_FLAGS+=(--insecure)
  HELM_FLAGS+=(--plain-http)
fi
# cosign verify's flags: the key is the only root of trust (no transparency log to check).
COSIGN_VERIFY_FLAGS=(--insecure-ignore-tlog=true)
if [ "${PLAIN_HTTP:-0}" = 1 ]; then
  COSIGN_VERIFY_FLAGS+=(--allow-http-registry --allow-insecure-registry)
fi

# chart_layer REF@DIGEST: prints the digest of the Helm chart layer of that chart manifest.
chart_layer() {
  "$CRANE" manifest "${CRANE_FLAGS[@]}" "$1" | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(next(l["digest"] for l in m["layers"] if l["mediaType"].endswith("chart.content.v1.tar+gzip")))'
}

# test_bed_key: prints the path of the test bed's cosign private key, making the pair (empty
# password) once.
test_bed_key() {
  local dir="$FL_CACHE/test-bed-key"
  if [ ! -f "$dir/cosign.key" ]; then
    mkdir -p "$dir"
    (cd "$dir" && COSIGN_PASSWORD="" "$COSIGN" generate-key-pair >/dev/null 2>"$dir/generate.log") ||
      die "cosign generate-key-pair failed (log: $dir/generate.log)"
  fi
  echo "$dir/cosign.key"
}

# image_binary ROLE: the binary hack/image.sh packages for ROLE (operator or sidecar) under
# FL_IMAGE_PROFILE (release by default).
image_binary() {
  local profile="${FL_IMAGE_PROFILE:-release}"
  if [ "$1" = sidecar ]; then sidecar_binary "$profile"; else echo "${CARGO_TARGET_DIR:-$FL_REPO/target}/$profile/fencedlease"; fi
}

# pin_chart DIR VERSION OPERATOR_REPO OPERATOR_DIGEST SIDECAR_REPO SIDECAR_DIGEST FINGERPRINT: sets
# the copy of the chart in DIR to VERSION (version and appVersion) and its two images to the
# pushed ones, by digest, in the values and in the Artifact Hub annotations, whose signKey gets
# FINGERPRINT. Fails when a file no longer has the lines it edits.
pin_chart() {
  python3 - "$@" <<'PY'
import re, sys
d, version, op_repo, op_digest, sc_repo, sc_digest, fingerprint = sys.argv[1:]
def edit(path, pairs):
    text = open(path).read()
    for pattern, repl in pairs:
        text, n = re.subn(pattern, repl, text, count=1, flags=re.M)
        if n != 1:
            sys.exit(f"pin_chart: {path} has no line matching {pattern!r}: update hack/release-lib.sh")
    open(path, "w").write(text)
edit(f"{d}/Chart.yaml", [(r'^version: .*$', f'version: {version}'),
                         (r'^appVersion: .*$', f'appVersion: "{version}"')])
if "artifacthub.io/images" in open(f"{d}/Chart.yaml").read():  # releases before 0.2.0 lack them
    edit(f"{d}/Chart.yaml", [
        (r'^(      image: )fencedlease:.*$', rf'\g<1>{op_repo}@{op_digest}'),
        (r'^(      image: )fencedlease-sidecar:.*$', rf'\g<1>{sc_repo}@{sc_digest}'),
        (r'^(    fingerprint: ).*$', rf'\g<1>{fingerprint}'),
        (r'^(    url: .*/download/)v[^/]*(/cosign.pub)$', rf'\g<1>v{version}\g<2>'),
        (r'^(  artifacthub.io/prerelease: ).*$', rf'\g<1>"{str("-" in version).lower()}"'),
    ])
edit(f"{d}/values.yaml", [
    (r'^(image:\n(?:  #.*\n)*  repository: ).*$', rf'\g<1>{op_repo}'),
    (r'^(image:\n(?:  .*\n)*?  digest: )"".*$', rf'\g<1>"{op_digest}"'),
    (r'^(    image:\n(?:      #.*\n)*      repository: )fencedlease-sidecar$', rf'\g<1>{sc_repo}'),
    (r'^(      repository: [^\n]*fencedlease-sidecar\n(?:      .*\n)*?      digest: )"".*$', rf'\g<1>"{sc_digest}"'),
])
PY
}

# check_pinned PACKAGE REF...: the packaged chart renders every REF (image@digest) and no image
# by tag: what the signature on the chart covers is then what the node runs.
check_pinned() {
  local package="$1"; shift
  local rendered
  rendered=$("$HELM" template fencedlease "$package" --namespace fencedlease-system) ||
    die "helm template of $package failed"
  for ref in "$@"; do
    grep -qF "$ref" <<<"$rendered" || die "the packaged chart does not render $ref: pin_chart missed a line"
  done
  if grep -E '^\s*image: ' <<<"$rendered" | grep -v '@sha256:' >&2; then
    die "the packaged chart renders an image without a digest (above)"
  fi
}

# build_source REF: unpacks commit or tag REF of this repository into target/release-src/COMMIT
# (SRC) and builds its two binaries once into $FL_CACHE/release-build/COMMIT-PROFILE
# (BINARY_operator, BINARY_sidecar). One cargo target folder serves every such build, so a second
# commit rebuilds only what changed.
build_source() {
  local ref="$1" commit profile dir target
  commit=$(git -C "$FL_REPO" rev-parse --verify --quiet "$ref^{commit}") ||
    die "--source $ref: no such commit or tag in $FL_REPO (a tag missing from a clone: git fetch --tags)"
  SRC="$FL_REPO/target/release-src/$commit"
  rm -rf "$SRC"
  mkdir -p "$SRC"
  git -C "$FL_REPO" archive "$commit" | tar -x -C "$SRC"
  export SOURCE_DATE_EPOCH
  SOURCE_DATE_EPOCH=$(git -C "$FL_REPO" log -1 --format=%ct "$commit")
  profile="${FL_IMAGE_PROFILE:-release}"
  dir="$FL_CACHE/release-build/$commit-$profile"
  target="$FL_CACHE/release-build/target"
  if [ ! -x "$dir/fencedlease" ] || [ ! -x "$dir/fencedlease-sidecar" ]; then
    local main_flags=() out_dir="$profile"
    [ "$profile" = release ] && main_flags=(--release)
    need_disk 8 "building $ref ($commit)" "$FL_CACHE"
    log "building $ref ($commit, profile $profile) once into $dir (cold: several minutes)"
    (cd "$SRC" && with_heartbeat "cargo build $ref" "$SRC/cargo-build.log" \
      env CARGO_TARGET_DIR="$target" CARGO_INCREMENTAL=0 cargo build --locked "${main_flags[@]}")
    (cd "$SRC" && with_heartbeat "cargo build $ref (sidecar)" "$SRC/cargo-build-sidecar.log" \
      env CARGO_TARGET_DIR="$target" CARGO_INCREMENTAL=0 cargo build --locked \
      --profile "$(sidecar_profile "$profile")" --no-default-features)
    mkdir -p "$dir.new"
    cp "$target/$out_dir/fencedlease" "$dir.new/fencedlease"
    cp "$target/$(sidecar_profile "$profile")/fencedlease" "$dir.new/fencedlease-sidecar"
    rm -rf "$dir"
    mv "$dir.new" "$dir"
  fi
  log "releasing $ref ($commit) from $SRC with the binaries in $dir"
  BINARY_operator="$dir/fencedlease"
  BINARY_sidecar="$dir/fencedlease-sidecar"
}

# The krew plugin (`kubectl fencedlease`): krew links the archive's `fencedlease` as
# kubectl-fencedlease, the name under which the binary runs the plugin's commands.
# plugin_archive OUT BINARY: writes the plugin's archive (the binary and LICENSE) to OUT.
plugin_archive() {
  local out="$1" binary="$2" work
  work=$(mktemp -d)
  install -m 0755 "$binary" "$work/fencedlease"
  cp "$FL_REPO/LICENSE" "$work/LICENSE"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work" -czf "$out" fencedlease LICENSE
  rm -rf "$work"
}

# krew_manifest VERSION URI SHA256: prints the krew manifest of the plugin (what krew-index
# holds for a release: the archive's address and checksum).
krew_manifest() {
  cat <<YAML
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: fencedlease
spec:
  version: v$1
  homepage: https://github.com/fencedlease/fencedlease
  shortDescription: Inspect fenced leader-election leases and their protected objects
  description: |
    kubectl fencedlease shows who holds each FencedLease and with which fencing token, checks
    that a namespace's workloads may campaign and that the fencing webhook judges their writes,
    hands a lease over, and deletes a protected object the only way anyone may: as the holder
    of its lease. It needs the fencedlease operator in the cluster
    (https://github.com/fencedlease/fencedlease).
  platforms:
    - selector:
        matchLabels:
          os: linux
          arch: amd64
      uri: $2
      sha256: $3
      bin: fencedlease
      files:
        - from: fencedlease
          to: .
        - from: LICENSE
          to: .
YAML
}
