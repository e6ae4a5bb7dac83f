#!/usr/bin/env bash
# The client-go peer as a container image, for the benchmarks that run candidates in pods on
# the bench cluster's node (failover-exited): no Docker, no registry.
#
#   bench/peer-image.sh PEER_BINARY VERSION   prints the image reference
#
# PEER_BINARY is what bench/build-peer.sh built (client-go's leader-election example of that
# release, static: CGO_ENABLED=0). The image: one layer with /usr/local/bin/leader-election-peer,
# /etc/passwd and /etc/group with user 65532, a 1777 /tmp; it runs as 65532 with the peer as its
# entrypoint. It is imported into the node's containerd (hack/node.sh must be up for the same
# FENCEDLEASE_CLUSTER_DIR); pods use it with imagePullPolicy: Never.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/lib.sh
source "$HERE/../hack/lib.sh"
# shellcheck source=hack/node/image-lib.sh
source "$HERE/../hack/node/image-lib.sh"

[ $# -eq 2 ] || die "usage: bench/peer-image.sh PEER_BINARY VERSION"
BIN="$1" VERSION="$2"
[ -x "$BIN" ] || die "$BIN is not an executable: build it with bench/build-peer.sh $VERSION"
linked=$(ldd "$BIN" 2>&1 || true)
grep -q "not a dynamic executable" <<<"$linked" ||
  die "$BIN is dynamically linked: the image carries no libraries (bench/build-peer.sh builds with CGO_ENABLED=0)"
node_containerd_running || die "the node's containerd does not answer ($(node_containerd_socket)): run hack/node.sh up first"

REF="localhost/fencedlease-bench/leader-election-peer:v$VERSION"
OUT_DIR="${FL_BENCH_CACHE:-$FL_CACHE/bench}/images"
mkdir -p "$OUT_DIR"
rootfs=$(mktemp -d "$OUT_DIR/.rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc" "$rootfs/tmp"
install -m 0755 "$BIN" "$rootfs/usr/local/bin/leader-election-peer"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
chmod 1777 "$rootfs/tmp"
chmod 0755 "$rootfs" "$rootfs/usr" "$rootfs/usr/local" "$rootfs/usr/local/bin" "$rootfs/etc"
ARCHIVE="$OUT_DIR/leader-election-peer-v$VERSION.tar"
docker_archive "$ARCHIVE" "$REF" "$rootfs" "65532:65532" /usr/local/bin/leader-election-peer >/dev/null
import_archive "$ARCHIVE" "$REF"
log "client-go peer v$VERSION imported into the node's containerd as $REF"
echo "$REF"
