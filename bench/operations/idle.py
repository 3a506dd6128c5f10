"""Idle always-on agent: resident memory, CPU and torch between runs.

Starts mosquitto and one ``dfl-agent run`` (no ``[algorithm]`` section: the supervisor
joins and waits for runs; signed federation, mDNS on 127.0.0.1, default status heartbeat),
lets it warm up, then samples the supervisor's RSS, PSS and USS, its CPU time and whether
its memory maps hold libtorch or SciPy's extension modules, every ``--every`` seconds for
``--minutes`` minutes.  Writes ``idle.json`` (the commit, samples, CPU %, RSS slope by least
squares after warm-up, MB per 10 minutes, ``torch_mapped``, ``scipy_mapped``) and exits 1 when
torch or SciPy was mapped or the agent died.

    nice -n 10 .venv/bin/python bench/operations/idle.py --minutes 3 --warmup 30 --out bench/operations

``--agent-pythonpath DIR`` runs the agent from another copy of the package (an earlier
version checked out and laid out as ``DIR/dfl_agent``); ``--name`` names the results file.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from runs_timing import invocation, node_config, start_agent

from dfl_agent.cli.broker import start_broker

MB = 2**20


def torch_mapped(pid: int) -> list[str]:
    """The libtorch files in ``/proc/PID/maps`` (empty: torch is not loaded)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-1] for ln in lines if "libtorch" in ln.split()[-1]})


def scipy_mapped(pid: int) -> list[str]:
    """SciPy's extension modules in ``/proc/PID/maps`` (empty: ``scipy`` is not imported)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-1] for ln in lines if "/scipy/" in ln.split()[-1] or "/scipy.libs/" in ln.split()[-1]})


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def memory(ps: psutil.Process) -> dict:
    """RSS, and PSS and USS where the kernel gives them, in MB."""
    out = {"rss_mb": ps.memory_info().rss / MB}
    try:
        full = ps.memory_full_info()
        out |= {"pss_mb": getattr(full, "pss", 0) / MB, "uss_mb": full.uss / MB}
    except (psutil.AccessDenied, AttributeError):
        pass
    return out


def machine() -> str:
    return f"{platform.machine()}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, " \
           f"load average {' '.join(f'{x:.1f}' for x in psutil.getloadavg())} at the start"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0, help="measurement length after warm-up")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds before sampling starts")
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--out", default="bench/operations", help="folder for idle.json")
    p.add_argument("--name", default="idle.json", help="file name of the results in --out")
    p.add_argument("--agent-pythonpath", metavar="DIR",
                   help="PYTHONPATH of the agent only: measure another version of the package")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dfl-idle-"))
    fed, fed_key, host = "idle", Ed25519PrivateKey.generate(), machine()
    with start_broker("mosquitto") as broker:
        cfg = node_config(tmp, fed_key, fed, "idle-0", broker.endpoint,
                          '[discovery]\nmdns = true\ninterfaces = ["127.0.0.1"]\n', heartbeat=None)
        proc = start_agent(cfg, tmp / "agent.log", a.agent_pythonpath)
        ps = psutil.Process(proc.pid)
        time.sleep(a.warmup)
        samples = []
        t_end = time.monotonic() + a.minutes * 60
        while time.monotonic() < t_end and proc.poll() is None:
            c = ps.cpu_times()
            samples.append({"t": time.monotonic(), **memory(ps), "cpu_s": c.user + c.system,
                            "threads": ps.num_threads(), "torch_mapped": torch_mapped(proc.pid),
                            "scipy_mapped": scipy_mapped(proc.pid)})
            time.sleep(a.every)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    log = (tmp / "agent.log").read_text()
    t = np.array([s["t"] for s in samples]) - samples[0]["t"]
    rss = np.array([s["rss_mb"] for s in samples])
    cpu_pct = 100.0 * (samples[-1]["cpu_s"] - samples[0]["cpu_s"]) / max(t[-1], 1e-9)
    slope = float(np.polyfit(t, rss, 1)[0]) * 600.0 if len(t) > 1 else 0.0
    mapped = sorted({f for s in samples for f in s["torch_mapped"]})
    scipy = sorted({f for s in samples for f in s["scipy_mapped"]})
    res = {"command": invocation(), "commit": commit(), "machine": host, "agent_pythonpath": a.agent_pythonpath, "minutes": round(t[-1] / 60, 2), "warmup_s": a.warmup,
           "agent_alive_throughout": alive, "serving": "waiting for runs" in log,
           "torch_mapped": mapped, "scipy_mapped": scipy, "cpu_percent": round(cpu_pct, 3),
           "rss_mb_first": round(rss[0], 1), "rss_mb_last": round(rss[-1], 1), "rss_mb_max": round(rss.max(), 1),
           "rss_slope_mb_per_10min": round(slope, 3)}
    if "pss_mb" in samples[-1]:
        res |= {"pss_mb_last": round(samples[-1]["pss_mb"], 1), "uss_mb_last": round(samples[-1]["uss_mb"], 1)}
    res |= {"target_rss_mb": 100, "within_target": bool(rss.max() <= 100 and not mapped and not scipy and alive),
            "samples": samples}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / a.name).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    return 0 if alive and not mapped and not scipy and res["serving"] else 1


if __name__ == "__main__":
    sys.exit(main())
