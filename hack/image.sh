#!/usr/bin/env bash
# Builds the project's container image, fencedlease:VERSION, with no Docker and no registry, and
# imports it into the local node's containerd (hack/node.sh) when that runs.
#
#   hack/image.sh            build (cargo build --release only when the binary is missing or
#                            older than the sources), write the archive, import it
#   FL_IMAGE_ROLE=sidecar hack/image.sh
#                            the same for the sidecar's image, fencedlease-sidecar:VERSION (the chart's
#                            injection.sidecar.image): the sidecar's build (Cargo.toml: the
#                            workload-side commands only, profile sidecar; see hack/lib.sh's
#                            sidecar_binary), built the same way when missing or older
#
# The image: one layer with /usr/local/bin/fencedlease, the shared libraries `ldd` names for
# it and the dynamic loader (the binary is linked against the build machine's glibc; the image
# carries that same glibc, so they match), /etc/passwd and /etc/group with user 65532
# (nonroot), a 1777 /tmp, and /var/run/fencedlease owned by 65532 (the sidecar's token folder).
# It runs as 65532:65532 with entrypoint /usr/local/bin/fencedlease. Pods use it with
# `image: fencedlease:VERSION` and `imagePullPolicy: Never` (or IfNotPresent): there is no registry.
#
# Output: target/image/fencedlease-VERSION.tar (fencedlease-sidecar-VERSION.tar), a docker-archive (manifest.json + config JSON +
# one layer tar), and the same image as an OCI image layout in target/image/fencedlease-VERSION.oci/
# (what hack/release.sh pushes); reproducible for the same binary. Idempotent.
# FL_IMAGE_IMPORT=0 skips the import into the node's containerd.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=hack/node/image-lib.sh
source "$(dirname "$0")/node/image-lib.sh"

# FL_IMAGE_VERSION=V tags the image V (hack/release.sh); the default is Cargo.toml's version.
VERSION="${FL_IMAGE_VERSION:-$(fl_version)}"
# FL_IMAGE_PROFILE=debug packages the debug binary the tests build (CI does, to spare a
# release build); the default is release.
PROFILE="${FL_IMAGE_PROFILE:-release}"
case "$PROFILE" in release) CARGO_FLAGS=(--release) ;; debug) CARGO_FLAGS=() ;; *) die "FL_IMAGE_PROFILE must be release or debug" ;; esac
ROLE="${FL_IMAGE_ROLE:-operator}"
case "$ROLE" in
  operator)
    NAME=fencedlease
    DEFAULT_BIN="${CARGO_TARGET_DIR:-$FL_REPO/target}/$PROFILE/fencedlease" ;;
  sidecar)
    NAME=fencedlease-sidecar
    CARGO_FLAGS=(--profile "$(sidecar_profile "$PROFILE")" --no-default-features)
    DEFAULT_BIN="$(sidecar_binary "$PROFILE")" ;;
  *) die "FL_IMAGE_ROLE must be operator or sidecar" ;;
esac
REF="$NAME:$VERSION"
# FL_IMAGE_BINARY=PATH packages that binary as it is (the benchmarks' private copy), no build.
BIN="${FL_IMAGE_BINARY:-$DEFAULT_BIN}"
OUT_DIR="$FL_REPO/target/image"
ARCHIVE="$OUT_DIR/$NAME-$VERSION.tar"
UID_NONROOT=65532

stale_binary() {
  if [ -n "${FL_IMAGE_BINARY:-}" ]; then
    [ -x "$BIN" ] || die "FL_IMAGE_BINARY=$BIN is not an executable"
    return 1
  fi
  [ -x "$BIN" ] || return 0
  [ -n "$(find "$FL_REPO/src" "$FL_REPO/elector/src" "$FL_REPO/elector/Cargo.toml" "$FL_REPO/Cargo.toml" "$FL_REPO/Cargo.lock" -newer "$BIN" -print -quit 2>/dev/null)" ]
}

mkdir -p "$OUT_DIR"
if stale_binary; then
  log "building the $PROFILE binary (cold: several minutes)"
  (cd "$FL_REPO" && with_heartbeat "cargo build ${CARGO_FLAGS[*]}" "$OUT_DIR/cargo-build.log" cargo build "${CARGO_FLAGS[@]}")
else
  log "packaging $BIN (up to date)"
fi

rootfs="$OUT_DIR/rootfs-$NAME"
rm -rf "$rootfs"
mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/var/run/fencedlease"
install -m 0755 "$BIN" "$rootfs/usr/local/bin/fencedlease"

# The loader and every library ldd resolves, at the paths ldd prints (the loader's own path is
# the one written in the binary's PT_INTERP, so the binary finds it).
libs=$(ldd "$BIN" | awk '/=> \// {print $3} /^[[:space:]]*\/[^ ]+ \(/ {print $1}')
[ -n "$libs" ] || die "ldd found no libraries for $BIN (a static binary needs none: remove this check)"
for lib in $libs; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
interp=$(readelf -l "$BIN" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
[ -z "$interp" ] || [ -e "$rootfs$interp" ] || die "the dynamic loader $interp is not in the layer (ldd printed: $libs)"

printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%s:%s:nonroot:/home/nonroot:/sbin/nologin\n' \
  "$UID_NONROOT" "$UID_NONROOT" >"$rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:%s:\n' "$UID_NONROOT" >"$rootfs/etc/group"
chmod 1777 "$rootfs/tmp"
chown "$UID_NONROOT:$UID_NONROOT" "$rootfs/var/run/fencedlease"
chmod 0755 "$rootfs/var/run/fencedlease"
chmod -R go-w,a+rX "$rootfs/usr" "$rootfs/etc"
for d in $(cd "$rootfs" && find . -mindepth 1 -maxdepth 1 -type d -name 'lib*'); do chmod -R go-w,a+rX "$rootfs/$d"; done

# Check the layer is complete: the binary runs in it, with only its files (chroot), as 65532.
chroot --userspec="$UID_NONROOT:$UID_NONROOT" "$rootfs" /usr/local/bin/fencedlease --version >/dev/null ||
  die "the image's binary does not run inside the image's own files (chroot $rootfs): a library is missing"

config_id=$(docker_archive "$ARCHIVE" "$REF" "$rootfs" "$UID_NONROOT:$UID_NONROOT" /usr/local/bin/fencedlease)
rm -rf "$rootfs"
log "image $REF written to $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1), config sha256:${config_id:0:12}, libraries: $(echo "$libs" | tr '\n' ',' | sed 's/,$//'))"

if [ "${FL_IMAGE_IMPORT:-1}" = 0 ]; then
  log "not imported (FL_IMAGE_IMPORT=0); OCI layout: ${ARCHIVE%.tar}.oci"
elif node_containerd_running; then
  import_archive "$ARCHIVE" "$REF"
  log "imported into the node's containerd as docker.io/library/$REF (pods: image: $REF, imagePullPolicy: Never)"
else
  log "the node's containerd is not running ($(node_containerd_socket)): not imported; run hack/node.sh up, then this script again"
fi
