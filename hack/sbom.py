#!/usr/bin/env python3
"""Writes a CycloneDX 1.5 SBOM (JSON) of one of the project's images.

    hack/sbom.py --role operator|sidecar --version V --binary PATH > fencedlease.cdx.json

What is in it: every Rust crate compiled into that role's build (cargo tree of the package with
the role's features, normal dependencies only, for the image's target), each with its license,
its crates.io checksum from Cargo.lock and a package URL; and the Debian packages whose files the
image carries (the shared libraries and loader that `ldd` names for the binary, as hack/image.sh
copies them), found with dpkg. The image itself is the top component.

Reproducible: the timestamp is SOURCE_DATE_EPOCH (default: the commit time of HEAD) and the
serial number is derived from the content, so the same sources give the same file.

Errors say what to do and exit 1; nothing is written to stdout then.
"""

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import uuid
from urllib.parse import quote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # --source overrides it
TARGET = "x86_64-unknown-linux-gnu"
ROLE_FEATURES = {"operator": [], "sidecar": ["--no-default-features"]}
IMAGE_NAME = {"operator": "fencedlease", "sidecar": "fencedlease-sidecar"}


def fail(message):
    print(f"hack/sbom.py: {message}", file=sys.stderr)
    sys.exit(1)


def run(args):
    try:
        return subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        fail(f"{' '.join(args)} failed: {detail.strip()}")


def crates(role):
    """(name, version, source, license) of each crate the role's build compiles."""
    out = run(["cargo", "tree", "--locked", "-p", "fencedlease", "-e", "normal", "--target", TARGET,
               "--prefix", "none", "--format", "{p}\t{l}", *ROLE_FEATURES[role]])
    seen = {}
    for line in out.splitlines():
        line = line.removesuffix(" (*)").strip()
        if not line:
            continue
        package, _, license_ = line.partition("\t")
        parts = package.split(" ")
        name, version = parts[0], parts[1].lstrip("v")
        source = " ".join(parts[2:]).strip("()")
        seen[(name, version)] = (name, version, source, license_.strip())
    if not seen:
        fail("cargo tree listed no crates: run it from the repository with Cargo.lock present")
    return sorted(seen.values())


def checksums():
    with open(os.path.join(REPO, "Cargo.lock"), "rb") as f:
        lock = tomllib.load(f)
    return {(p["name"], p["version"]): p.get("checksum") for p in lock.get("package", [])}


def crate_component(name, version, source, license_, sums):
    purl = f"pkg:cargo/{name}@{version}"
    component = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
    if license_:
        component["licenses"] = [{"expression": license_.replace("/", " OR ")}]
    checksum = sums.get((name, version))
    if checksum:
        component["hashes"] = [{"alg": "SHA-256", "content": checksum}]
    if source and not source.startswith("registry"):
        component["properties"] = [{"name": "fencedlease:source", "value": "this repository"}]
    return component


def libraries(binary):
    """The files hack/image.sh copies: what ldd resolves, and the loader."""
    paths = []
    for line in run(["ldd", binary]).splitlines():
        words = line.split()
        if "=>" in words and len(words) >= 3 and words[2].startswith("/"):
            paths.append(words[2])
        elif words and words[0].startswith("/"):
            paths.append(words[0])
    return paths


def deb_component(path):
    real = os.path.realpath(path)
    for candidate in (path, real):
        try:
            owner = subprocess.run(["dpkg", "-S", candidate], check=True, capture_output=True,
                                   text=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            owner = ""
    if not owner:
        fail(f"dpkg does not know which package holds {path}: build the image on Debian, "
             "where every library the binary needs comes from a package")
    package = owner.split(":")[0].strip()
    fields = run(["dpkg-query", "-W", "-f", "${Version}\t${Architecture}", package]).split("\t")
    version, arch = fields[0], fields[1]
    purl = f"pkg:deb/debian/{package}@{quote(version)}?arch={arch}"
    return {"type": "library", "bom-ref": purl, "name": package, "version": version,
            "purl": purl, "properties": [{"name": "fencedlease:file", "value": path}]}


def timestamp():
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or run(["git", "log", "-1", "--format=%ct"]).strip()
    return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=sorted(ROLE_FEATURES), required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--binary", required=True, help="the binary the image carries")
    parser.add_argument("--source", help="the source tree the binary was built from (default: "
                        "this repository)")
    args = parser.parse_args()
    if args.source:
        global REPO
        REPO = os.path.abspath(args.source)
    if not os.access(args.binary, os.X_OK):
        fail(f"--binary {args.binary} is not an executable: build it first (hack/image.sh does)")

    sums = checksums()
    components = [crate_component(*c, sums) for c in crates(args.role)]
    debs = {}
    for path in libraries(args.binary):
        component = deb_component(path)
        known = debs.setdefault(component["bom-ref"], component)
        if known is not component:
            known["properties"] += component["properties"]
    components += sorted(debs.values(), key=lambda c: c["bom-ref"])

    name = IMAGE_NAME[args.role]
    image = {"type": "container", "bom-ref": f"image:{name}@{args.version}", "name": name,
             "version": args.version, "licenses": [{"license": {"id": "Apache-2.0"}}]}
    body = {"components": components, "image": image}
    serial = uuid.UUID(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32])
    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {
            "timestamp": timestamp(),
            "tools": {"components": [{"type": "application", "name": "fencedlease hack/sbom.py"}]},
            "component": image,
        },
        "components": components,
    }
    json.dump(bom, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
