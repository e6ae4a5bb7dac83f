"""Folds a full run into the record (bench/results/full-record/): the benchmarks it ran replace
the record's, the others stay, and sources.json says which run each figure comes from, with
that run's command and machine (load average before and after). Then the record is reported
like a run (report.py) into bench/results/summary-full.json and bench/plots/.

The record holds runs of one Kubernetes release (the API server's and the client-go peer's):
figures of two releases side by side would compare different servers. A run on another release
than the record's first moves the record, as it stands, to DIR-k8s-<its release> beside it (kept
in git as history, with a copy of --plots), and starts a new record.

Usage: record.py RUN_DIR NAME... --record DIR --kubernetes VERSION --command "bench/run.sh --full ..."
       [--plots DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def release_of(run: dict) -> str:
    """The Kubernetes release of a run in sources.json (runs before releases were recorded: the
    API server's --version in its machine description)."""
    if run.get("kubernetes"):
        return run["kubernetes"]
    v = ((run.get("machine_before") or {}).get("kube_apiserver") or "").removeprefix("Kubernetes v")
    return v or "unknown"


def raw_samples(doc) -> list[str]:
    """Every `raw_samples` file a result names (relative to its run), at any depth."""
    if isinstance(doc, dict):
        own = [doc["raw_samples"]] if isinstance(doc.get("raw_samples"), str) else []
        return own + [r for v in doc.values() for r in raw_samples(v)]
    if isinstance(doc, list):
        return [r for v in doc for r in raw_samples(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--kubernetes", required=True, help="the release of the run's server and peer")
    ap.add_argument("--plots", type=Path, help="the record's plots, copied along when it is moved")
    args = ap.parse_args()
    run, record = args.run, args.record
    sources_path = record / "sources.json"
    if sources_path.exists():
        old = json.loads(sources_path.read_text())
        releases = sorted({release_of(r) for r in old["runs"].values()})
        if releases != [args.kubernetes]:
            archive = record.with_name(f"{record.name}-k8s-{'+'.join(releases)}")
            if archive.exists():
                raise SystemExit(f"{archive} exists already: move it away to start a record on "
                                 f"Kubernetes {args.kubernetes}; the record is unchanged")
            shutil.move(record, archive)
            if args.plots and args.plots.is_dir():
                shutil.copytree(args.plots, archive / "plots")
            print(f"record: the record of Kubernetes {', '.join(releases)} moved to {archive}; "
                  f"a new record of Kubernetes {args.kubernetes} starts")
    record.mkdir(parents=True, exist_ok=True)
    used = []
    for name in args.names:
        if name == "decision":
            src = run / "criterion"
            if not src.is_dir():
                raise SystemExit(f"{src} is missing: the decision benchmark did not write its estimates")
            shutil.rmtree(record / "criterion", ignore_errors=True)
            shutil.copytree(src, record / "criterion")
        else:
            src = run / f"{name}.json"
            if not src.exists():
                raise SystemExit(f"{src} is missing: {name} did not finish, the record is unchanged")
            shutil.copy(src, record / src.name)
            for rel in raw_samples(json.loads(src.read_text())):
                if (run / rel).exists():  # the per-request samples the figures are recomputed from
                    (record / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(run / rel, record / rel)
        used.append(name)

    sources = json.loads(sources_path.read_text()) if sources_path.exists() else {"runs": {}}
    sources["note"] = ("The record is assembled from full runs of bench/run.sh on this machine: each "
                       "benchmark's figures come from the newest full run that ran it (see runs), "
                       "all on one Kubernetes release (the API server's and the client-go peer's).")
    sources["kubernetes"] = args.kubernetes
    for other in sources["runs"].values():
        other["used_for"] = [n for n in other["used_for"] if n not in used]
    sources["runs"] = {k: v for k, v in sources["runs"].items() if v["used_for"]}

    def machine(f: str) -> dict | None:
        p = run / f
        return json.loads(p.read_text()) if p.exists() else None

    sources["runs"][run.name] = {"command": args.command, "used_for": used,
                                 "kubernetes": args.kubernetes, "versions": machine("versions.json"),
                                 "machine_before": machine("machine.json"),
                                 "machine_after": machine("machine-after.json")}
    sources_path.write_text(json.dumps(sources, indent=1) + "\n")
    for f in ("machine.json", "machine-after.json", "versions.json"):
        if (run / f).exists():
            shutil.copy(run / f, record / f)
    print(f"record: {', '.join(used)} from {run.name}; "
          f"runs in the record: {', '.join(sorted(sources['runs']))}")


if __name__ == "__main__":
    main()
