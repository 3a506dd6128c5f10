"""Idle always-on agent: RSS and CPU between runs.

Starts mosquitto and one ``dfl-agent run`` (no ``[algorithm]`` section: it joins and
waits for runs), lets it warm up, then samples its RSS and CPU time every ``--every``
seconds for ``--minutes`` minutes.  Writes ``idle.json`` (samples, CPU %, RSS slope by
least squares after warm-up, MB per 10 minutes).

    nice -n 10 python bench/operations/idle.py --minutes 10 --out bench/operations
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from dfl_agent.cli.broker import start_broker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="measurement length after warm-up")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before sampling starts")
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--out", default="bench/operations", help="folder for idle.json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dfl-idle-"))
    with start_broker("mosquitto") as broker:
        cfg = tmp / "node.toml"
        cfg.write_text(f'federation = "idle"\nnode_id = "idle-0"\nstate_dir = "{tmp / "state"}"\n'
                       f'[mqtt]\nbroker = "{broker.endpoint}"\n[discovery]\nmdns = true\ninterfaces = ["127.0.0.1"]\n')
        proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.daemon", "run", "--config", str(cfg)],
                                stdout=open(tmp / "agent.log", "w"), stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        time.sleep(a.warmup)
        samples = []
        t_end = time.monotonic() + a.minutes * 60
        while time.monotonic() < t_end and proc.poll() is None:
            c = ps.cpu_times()
            samples.append({"t": time.monotonic(), "rss_mb": ps.memory_info().rss / 2**20, "cpu_s": c.user + c.system})
            time.sleep(a.every)
        alive = proc.poll() is None
        proc.terminate()
        proc.wait(timeout=30)
    t = np.array([s["t"] for s in samples]) - samples[0]["t"]
    rss = np.array([s["rss_mb"] for s in samples])
    cpu_pct = 100.0 * (samples[-1]["cpu_s"] - samples[0]["cpu_s"]) / max(t[-1], 1e-9)
    slope = float(np.polyfit(t, rss, 1)[0]) * 600.0 if len(t) > 1 else 0.0
    res = {"command": "nice -n 10 python bench/operations/idle.py " + " ".join(sys.argv[1:]),
           "minutes": round(t[-1] / 60, 2), "warmup_s": a.warmup, "agent_alive_throughout": alive,
           "cpu_percent": round(cpu_pct, 3), "rss_mb_first": round(rss[0], 1), "rss_mb_last": round(rss[-1], 1),
           "rss_slope_mb_per_10min": round(slope, 3), "samples": samples}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
