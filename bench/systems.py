"""The two systems under test, started the same way: `fencedlease campaign` and the client-go
peer (bench/build-peer.sh). Both write JSON lines {t_ns, identity, event} on leadership changes.

OURS_OPT_OUT is fencedlease again, on leases with `spec.revokeOnHolderDeath: false` (the
failover-podgone benchmark's control: the same event without the controller's early revocation).
"""

from __future__ import annotations

from pathlib import Path

from lib import API_PORT, FENCEDLEASE, PEER, BENCH, Proc, admin_token, ca_file, fl_path, lease_path
from takeover import TIMELINE

OURS = "fencedlease"
PEER_NAME = "client-go"
SYSTEMS = (OURS, PEER_NAME)
OURS_OPT_OUT = "fencedlease-opted-out"


def is_ours(system: str) -> bool:
    """Whether `system` runs `fencedlease campaign` on a FencedLease (else the client-go peer)."""
    return system in (OURS, OURS_OPT_OUT)


def peer_timings(lease_s: float) -> tuple[float, float, float]:
    """client-go's usual 15 s / 10 s / 2 s, scaled to the lease duration."""
    return lease_s, lease_s * 10 / 15, lease_s * 2 / 15


def start_candidate(system: str, *, name: str, ns: str, lease: str, identity: str, lease_s: int,
                    kubeconfig: Path, logdir: Path, events: Path, writes: Path | None = None,
                    cm: str | None = None, api: str | None = None, timeline: bool = False) -> Proc:
    """`api`: where the fenced write goes (default: the API server; failover under load: the
    same delay proxy as the kubeconfig's server). `timeline`: fencedlease logs in JSON lines,
    with the elector's timeline (bench/takeover.py reads it) beside its warnings."""
    env = {"KUBECONFIG": str(kubeconfig)}
    if is_ours(system):
        if cm and writes:
            cmd = ["sh", str(BENCH / "fenced-write.sh")]
            env.update({"BENCH_CA": str(ca_file()), "BENCH_API_TOKEN": admin_token(),
                        "BENCH_API": api or f"https://127.0.0.1:{API_PORT}", "BENCH_CM": cm,
                        "BENCH_WRITES": str(writes)})
        else:
            cmd = ["sleep", "100000"]
        env["RUST_LOG"] = f"warn,{TIMELINE}=debug" if timeline else "warn"
        if timeline:
            env["FENCEDLEASE_LOG_FORMAT"] = "json"
        argv = [str(FENCEDLEASE), "campaign", "--lease", lease, "--namespace", ns,
                "--identity", identity, "--lease-duration", str(lease_s), "--grace-seconds", "2",
                "--events-file", str(events), "--", *cmd]
    else:
        d, r, p = peer_timings(lease_s)
        argv = [str(PEER), "-kubeconfig", str(kubeconfig), "-id", identity,
                "-lease-lock-name", lease, "-lease-lock-namespace", ns,
                "-lease-duration", f"{d}s", "-renew-deadline", f"{r}s", "-retry-period", f"{p}s",
                "-events-file", str(events)]
    return Proc(name, argv, logdir, env=env, events=events)


def object_path(system: str, ns: str, lease: str) -> str:
    return fl_path(ns, lease) if is_ours(system) else lease_path(ns, lease)


def renew_time(system: str, obj: dict | None) -> str | None:
    """The holder's last renewal as it wrote it (both set it just before sending the write)."""
    if not obj:
        return None
    if is_ours(system):
        return (obj.get("status") or {}).get("renewTime")
    return (obj.get("spec") or {}).get("renewTime")


def holder_of(system: str, obj: dict | None) -> str | None:
    if not obj:
        return None
    return (obj.get("spec") or {}).get("holderIdentity") or None
