#!/usr/bin/env bash
# Checks the release's own files with the tools their ecosystems use (hack/test.sh runs it):
#
#   1. .github/workflows/*.yml with actionlint, which runs shellcheck (installed here) on the
#      workflows' scripts;
#   2. the krew manifest hack/release.sh writes, with krew's own validate-krew-manifest, which
#      installs the plugin from its archive: here an archive of the debug binary served on
#      loopback, so the check covers the archive's layout, checksum and `bin` too;
#   3. the chart's Artifact Hub metadata (Chart.yaml annotations parse, and name real files).
#
# The tools come from hack/gotool.sh (built once). Needs target/debug/fencedlease (cargo build).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
PLAIN_HTTP=0
# shellcheck source=hack/release-lib.sh
source "$(dirname "$0")/release-lib.sh"
apt_install shellcheck

"$("$FL_REPO/hack/gotool.sh" actionlint)" -no-color "$FL_REPO"/.github/workflows/*.yml ||
  die "actionlint found problems in .github/workflows (above)"
log "workflows: actionlint clean"

binary="${CARGO_TARGET_DIR:-$FL_REPO/target}/debug/fencedlease"
[ -x "$binary" ] || die "$binary is missing: run cargo build first"
work=$(mktemp -d)
server_pid=""
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$work"' EXIT
version=$(fl_version)
archive="fencedlease-v$version-linux-amd64.tar.gz"
mkdir -p "$work/serve" "$work/home"
plugin_archive "$work/serve/$archive" "$binary"
python3 -m http.server --bind 127.0.0.1 0 --directory "$work/serve" >"$work/http.log" 2>&1 &
server_pid=$!
port=""
for _ in $(seq 50); do
  port=$(sed -n 's/.*port \([0-9][0-9]*\).*/\1/p' "$work/http.log" | head -n1)
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || die "python3 -m http.server did not start (log: $(cat "$work/http.log"))"
krew_manifest "$version" "http://127.0.0.1:$port/$archive" "$(sha256sum "$work/serve/$archive" | cut -d' ' -f1)" \
  >"$work/fencedlease.yaml"
# The check runs `kubectl krew install --manifest`: krew goes on PATH as the kubectl plugin
# kubectl-krew; its installs go to a scratch KREW_ROOT.
mkdir -p "$work/bin"
ln -s "$("$FL_REPO/hack/gotool.sh" krew)" "$work/bin/kubectl-krew"
PATH="$work/bin:$PATH" HOME="$work/home" KREW_ROOT="$work/krew" "$("$FL_REPO/hack/gotool.sh" validate-krew-manifest)" \
  -manifest "$work/fencedlease.yaml" >"$work/validate.log" 2>&1 || {
  cat "$work/validate.log" >&2
  die "validate-krew-manifest refused the plugin manifest (above)"
}
log "krew manifest: validate-krew-manifest installed the plugin from its archive"

python3 - "$FL_REPO/charts/fencedlease/Chart.yaml" "$FL_REPO" <<'PY' || die "the chart's Artifact Hub metadata is wrong (above)"
import os, sys, yaml
chart = yaml.safe_load(open(sys.argv[1]))
repo = sys.argv[2]
for key in ("home", "sources", "maintainers", "icon"):
    assert chart.get(key), f"Chart.yaml has no {key}"
notes = chart.get("annotations", {})
for key in ("artifacthub.io/changes", "artifacthub.io/license", "artifacthub.io/links",
            "artifacthub.io/images", "artifacthub.io/crds", "artifacthub.io/signKey"):
    assert key in notes, f"Chart.yaml has no annotation {key}"
for change in yaml.safe_load(notes["artifacthub.io/changes"]):
    assert change["kind"] in {"added", "changed", "deprecated", "removed", "fixed", "security"}, change
    assert change["description"], change
for image in yaml.safe_load(notes["artifacthub.io/images"]):
    assert image["image"].endswith(":" + chart["appVersion"]), f"{image} is not at appVersion {chart['appVersion']}"
for crd in yaml.safe_load(notes["artifacthub.io/crds"]):
    assert crd["kind"] == "FencedLease" and crd["version"] == "v1alpha1", crd
key = yaml.safe_load(notes["artifacthub.io/signKey"])
assert key["url"].endswith(f"/v{chart['version']}/cosign.pub") and key["fingerprint"], key
prefix = "https://raw.githubusercontent.com/fencedlease/fencedlease/main/"
assert chart["icon"].startswith(prefix), chart["icon"]
assert os.path.exists(os.path.join(repo, chart["icon"][len(prefix):])), f"no file for the icon {chart['icon']}"
print("chart metadata: Artifact Hub annotations present and consistent")
PY
