"""Wall time of ``dflctl --version`` (and ``dfl-infer --version``): median of N runs.

Run:  nice -n 10 .venv/bin/python bench/cli/bench_startup.py --repeats 15 --out bench/cli/results.json
Target: under 0.5 s for ``dflctl --version``."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(cmd: list[str], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {"command": " ".join(cmd), "repeats": repeats, "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3), "max_s": round(max(times), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=15, help="runs per command")
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args()
    bindir = Path(sys.executable).parent
    rows = []
    for name, args in (("dflctl", ["--version"]), ("dflctl", ["peers", "--help"]), ("dfl-infer", ["--version"])):
        exe = str(bindir / name) if (bindir / name).exists() else shutil.which(name)
        if exe:
            rows.append(measure([exe, *args], a.repeats))
    doc = {"python": platform.python_version(), "machine": platform.machine(), "results": rows}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    ok = rows and rows[0]["median_s"] < 0.5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
