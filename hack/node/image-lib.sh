# Container images without Docker and without a registry: a docker-archive tarball
# (manifest.json + config JSON + one layer tar) that `ctr images import` understands.
# Source it after hack/lib.sh; do not run it.
# shellcheck shell=bash

# docker_archive OUT REF ROOTFS USER ENTRYPOINT...
#   Packs the folder ROOTFS (ownership and modes as they are on disk) into one layer and
#   writes the docker-archive OUT tagged REF, whose image runs ENTRYPOINT as USER.
#   Reproducible: same files give the same layer and config digests (mtimes are zeroed).
docker_archive() {
  local out="$1" ref="$2" rootfs="$3" user="$4"; shift 4
  local work
  work=$(mktemp -d "$(dirname "$out")/.archive.XXXXXX")
  # Entries without a leading "./", sorted, numeric owners, fixed mtime.
  (cd "$rootfs" && find . -mindepth 1 -maxdepth 1 -printf '%P\n' | LC_ALL=C sort) >"$work/top"
  tar --sort=name --mtime=@0 --numeric-owner --format=gnu -C "$rootfs" -cf "$work/layer.tar" -T "$work/top"
  local diff_id
  diff_id=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
  mkdir -p "$work/$diff_id"
  mv "$work/layer.tar" "$work/$diff_id/layer.tar"

  local entry="" arg
  for arg in "$@"; do entry+="${entry:+,}\"$arg\""; done
  # Every value here comes from this repository's scripts: no JSON escaping is needed.
  printf '%s' "{\"architecture\":\"amd64\",\"os\":\"linux\",\"created\":\"1970-01-01T00:00:00Z\",\
\"config\":{\"User\":\"$user\",\"Entrypoint\":[$entry],\"Env\":[\"PATH=/usr/local/bin:/usr/bin:/bin\"],\"WorkingDir\":\"/\",\
\"Labels\":{\"org.opencontainers.image.title\":\"${ref%%:*}\",\"org.opencontainers.image.version\":\"${ref##*:}\",\"org.opencontainers.image.source\":\"https://github.com/fencedlease/fencedlease\",\"org.opencontainers.image.licenses\":\"Apache-2.0\",\"io.fencedlease.built-by\":\"fencedlease hack scripts\"}},\
\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$diff_id\"]},\
\"history\":[{\"created\":\"1970-01-01T00:00:00Z\",\"created_by\":\"fencedlease hack scripts (no Dockerfile)\"}]}" \
    >"$work/config.json"
  local config_id
  config_id=$(sha256sum "$work/config.json" | cut -d' ' -f1)
  mv "$work/config.json" "$work/$config_id.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' \
    "$config_id" "$ref" "$diff_id" >"$work/manifest.json"
  oci_layout "${out%.tar}.oci" "${ref##*:}" "$work/$config_id.json" "$work/$diff_id/layer.tar"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu \
    -C "$work" -cf "$out.tmp" manifest.json "$config_id.json" "$diff_id"
  mv "$out.tmp" "$out"
  rm -rf "$work"
  echo "$config_id"
}

# oci_layout DIR TAG CONFIG LAYER_TAR
#   Writes the same image as an OCI image layout (the OCI image spec's folder form: oci-layout,
#   index.json, blobs/sha256/...) with OCI media types and the layer gzipped, for pushing to a
#   registry (hack/release.sh: `crane push DIR REF`). Reproducible: `gzip -n` stores no name or
#   time, so the same layer gives the same digests.
oci_layout() {
  local dir="$1" tag="$2" config="$3" layer="$4"
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp/blobs/sha256"
  local gz="$dir.tmp/layer.tar.gz" layer_id config_id manifest_id
  gzip -n -c "$layer" >"$gz"
  layer_id=$(sha256sum "$gz" | cut -d' ' -f1)
  mv "$gz" "$dir.tmp/blobs/sha256/$layer_id"
  config_id=$(sha256sum "$config" | cut -d' ' -f1)
  cp "$config" "$dir.tmp/blobs/sha256/$config_id"
  printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$config_id\",\"size\":$(stat -c %s "$config")},\
\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$layer_id\",\"size\":$(stat -c %s "$dir.tmp/blobs/sha256/$layer_id")}]}" \
    >"$dir.tmp/manifest.json"
  manifest_id=$(sha256sum "$dir.tmp/manifest.json" | cut -d' ' -f1)
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_id" "$(stat -c %s "$dir.tmp/manifest.json")" "$tag" >"$dir.tmp/index.json"
  mv "$dir.tmp/manifest.json" "$dir.tmp/blobs/sha256/$manifest_id"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$dir.tmp/oci-layout"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
}

# node_containerd_socket: the containerd socket of hack/node.sh for this cluster folder.
node_containerd_socket() { echo "$FL_CLUSTER_DIR/node/containerd/containerd.sock"; }

# node_ctr ARGS...: ctr against the node's containerd, in the namespace the kubelet uses.
node_ctr() { ctr --address "$(node_containerd_socket)" --namespace k8s.io "$@"; }

# node_has_image REF: true when the node's containerd holds the image REF (full name).
node_has_image() {
  local listed
  listed=$(node_ctr images ls -q 2>/dev/null) || return 1
  grep -qx "$1" <<<"$listed"
}

# node_containerd_running: true when the node's containerd answers.
node_containerd_running() {
  [ -S "$(node_containerd_socket)" ] && node_ctr version >/dev/null 2>&1
}

# import_archive FILE REF: imports a docker-archive into the node's containerd (idempotent:
# identical content is not stored twice) and checks that REF is there afterwards.
import_archive() {
  local file="$1" ref="$2" full
  case "$ref" in
    */*) full="$ref" ;;
    *) full="docker.io/library/$ref" ;;
  esac
  node_ctr images import "$file" >/dev/null ||
    die "ctr images import $file failed (containerd log: $FL_CLUSTER_DIR/logs/containerd.log)"
  local listed
  listed=$(node_ctr images ls -q)
  grep -qx "$full" <<<"$listed" ||
    die "after importing $file, containerd does not list $full (it lists: $(tr '\n' ' ' <<<"$listed"))"
}
