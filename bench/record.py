"""Folds a full run into the record (bench/results/full-record/): the benchmarks it ran replace
the record's, the others stay, and sources.json says which run each figure comes from, with
that run's command and machine (load average before and after). Then the record is reported
like a run (report.py) into bench/results/summary-full.json and bench/plots/.

Usage: record.py RUN_DIR NAME... --record DIR --command "bench/run.sh --full ..."
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--command", required=True)
    args = ap.parse_args()
    run, record = args.run, args.record
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
        used.append(name)

    sources_path = record / "sources.json"
    sources = json.loads(sources_path.read_text()) if sources_path.exists() else {"runs": {}}
    sources["note"] = ("The record is assembled from full runs of bench/run.sh on this machine: each "
                       "benchmark's figures come from the newest full run that ran it (see runs).")
    for other in sources["runs"].values():
        other["used_for"] = [n for n in other["used_for"] if n not in used]
    sources["runs"] = {k: v for k, v in sources["runs"].items() if v["used_for"]}

    def machine(f: str) -> dict | None:
        p = run / f
        return json.loads(p.read_text()) if p.exists() else None

    sources["runs"][run.name] = {"command": args.command, "used_for": used,
                                 "machine_before": machine("machine.json"),
                                 "machine_after": machine("machine-after.json")}
    sources_path.write_text(json.dumps(sources, indent=1) + "\n")
    for f in ("machine.json", "machine-after.json"):
        if (run / f).exists():
            shutil.copy(run / f, record / f)
    print(f"record: {', '.join(used)} from {run.name}; "
          f"runs in the record: {', '.join(sorted(sources['runs']))}")


if __name__ == "__main__":
    main()
