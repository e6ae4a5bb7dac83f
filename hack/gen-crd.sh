#!/usr/bin/env bash
# Regenerates crds/ from the Rust types (elector/src/api.rs): the CRD with CEL validation rules (for
# Kubernetes 1.25 and later), the one without them in crds/pre-1.25/, and the chart's copy of
# the first. A test fails when any of them differs.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"
mkdir -p crds/pre-1.25
cargo run --quiet -- crd >crds/fencedleases.fencedlease.io.yaml
cargo run --quiet -- crd --without-validation-rules >crds/pre-1.25/fencedleases.fencedlease.io.yaml
cp crds/fencedleases.fencedlease.io.yaml charts/fencedlease/crds/
log "wrote crds/fencedleases.fencedlease.io.yaml, crds/pre-1.25/ and the chart's copy"
