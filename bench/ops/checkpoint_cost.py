"""Cost of a crash-safe checkpoint (write with fsync + rename, verified load) for the
models the agent ships, and the unit's systemd-analyze security score.

    nice -n 10 .venv/bin/python bench/ops/checkpoint_cost.py [--repeat 5]

Writes bench/ops/results/checkpoint_cost.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    from dfl_agent.models import build_model, default_spec
    from dfl_agent.models.families import family_specs
    from dfl_agent.runtime.node.checkpoint import CheckpointStore

    specs = {f"har/{s}": default_spec((9, 128), 6, s) for s in ("small", "medium", "large")}
    specs.update({f"H2/{i}": s for i, s in enumerate(family_specs("H2", (9, 128), 6))})
    rows = []
    for name, spec in specs.items():
        m = build_model(spec)
        # DFML's state: regular + peak model
        tensors = {f"{w}.{k}": v.detach().numpy().copy() for w in ("regular", "peak") for k, v in m.state_dict().items()}
        nbytes = sum(v.nbytes for v in tensors.values())
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            store = CheckpointStore(d)
            saves, loads = [], []
            for t in range(1, a.repeat + 1):
                t0 = time.perf_counter()
                store.save(t, tensors, {"alpha_n": 0.5, "rotation": {"completed": t}})
                saves.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ck = store.load_latest()
                loads.append(time.perf_counter() - t0)
                assert ck is not None and ck.round == t
            disk = sum(f.stat().st_size for f in Path(d).iterdir()) / 2
        rows.append({"model": name, "type": spec["type"], "state_bytes": nbytes,
                     "checkpoint_bytes_on_disk": int(disk),
                     "save_ms_median": 1000 * statistics.median(saves), "load_ms_median": 1000 * statistics.median(loads)})
        print(f"{name:10s} {nbytes / 1e6:7.2f} MB  save {rows[-1]['save_ms_median']:7.1f} ms  "
              f"load {rows[-1]['load_ms_median']:6.1f} ms")
    security = None
    if shutil.which("systemd-analyze"):
        unit = Path(__file__).resolve().parents[2] / "systemd" / "dfl-agent.service"
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d) / "dfl-agent.service"
            tmp.write_text(unit.read_text().replace("/usr/local/bin/dfl-agent", shutil.which("python3") or "/bin/true"))
            r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(tmp)], capture_output=True,
                               text=True)
            line = [ln for ln in (r.stdout + r.stderr).splitlines() if "Overall exposure level" in ln]
            security = line[-1].strip() if line else None
            print(security)
    out = Path(__file__).parent / "results" / "checkpoint_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "systemd_analyze_security": security, "repeat": a.repeat,
                               "machine": platform.platform(), "torch": torch.__version__,
                               "file_system": "/var/tmp"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
