#!/usr/bin/env bash
# Regenerates crds/ from the Rust types (src/api.rs). A test fails when they differ.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"
cargo run --quiet -- crd >crds/fencedleases.fencedlease.io.yaml
log "wrote crds/fencedleases.fencedlease.io.yaml"
