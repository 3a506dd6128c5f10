"""How long the field lab's smoke test takes as CI runs it, repeated, with the load it ran under.

Runs ``python -m pytest -q -p no:cacheprovider tests/field/test_lab_smoke.py`` (the command of
``.ci/run``, limited to this file, with ``-s -rA --durations=0`` added to read the lab's own time
and each test's) ``--runs`` times, one after the other, as root. For each run it records the
wall time of pytest, the result line, each test's duration, the smoke lab run's own time
(``(lab run took N s)``), the 1-minute load average before, after and sampled every 5 s during
the run (mean and max), the run's state, rounds and failed checks from its report, the median wall time of the training
devices' rounds (``round_wall_s`` of their round records), the lab's timeline lines, and the
lab network namespaces (``dfl-lab-*``) left afterwards, which must be none. The smoke report of run
``i`` is copied to ``report-<i>.md``.

Usage (as root, from the repository root)::

    .venv/bin/python bench/lab/smoke_time.py --runs 3 --out bench/lab/results/smoke

Writes ``OUT/timings.json`` and ``OUT/timings.md`` (a table and the spread) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/field/test_lab_smoke.py"


def _load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("dfl-lab-")]


def machine() -> dict[str, Any]:
    """The CPU model, cores, memory and kernel of this host."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def one_run(i: int, out: Path) -> dict[str, Any]:
    """Run the smoke test file once; what it took and under which load."""
    base = Path(tempfile.mkdtemp(prefix=f"smoke-time-{i}-"))
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            samples.append(_load1())

    before = _load1()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST, "-s", "-rA",
                        "--durations=0", f"--basetemp={base}"], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    done.set()
    sampler.join()
    text = p.stdout + p.stderr
    lab = re.search(r"\(lab run took (\d+) s\)", text)
    result = next((line.strip("= ") for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                  "")
    durations = {m.group(2): float(m.group(1)) for m in re.finditer(r"([\d.]+)s call\s+\S+::(\w+)", text)}
    row: dict[str, Any] = {
        "run": i, "exit_code": p.returncode, "result": result, "pytest_wall_s": round(wall, 1),
        "lab_run_s": int(lab.group(1)) if lab else None, "test_call_s": durations,
        "load1_before": before, "load1_after": _load1(),
        "load1_during_mean": round(statistics.mean(samples), 2) if samples else None,
        "load1_during_max": max(samples) if samples else None,
        "namespaces_left": _namespaces(),
        # the smoke lab's own timeline, as the test prints it: when the run trained everywhere,
        # the events, and whether every run ended or the scenario's duration ran out
        "timeline": re.findall(r"^\[ *[\d.]+ s\] .*$", text, re.M)[:20],
    }
    report = base / "test_the_smoke_scenario0" / "smoke"
    if (report / "report.json").exists():
        rep = json.loads((report / "report.json").read_text())
        run = rep["runs"][0] if rep.get("runs") else {}
        row.update(passed=rep["passed"], failed_checks=rep["failed_checks"], run_state=run.get("state"),
                   rounds=run.get("rounds"), final_accuracy_mean=run.get("final_accuracy_mean"),
                   lab_wall_seconds=rep.get("wall_seconds"),
                   events=[{k: e.get(k) for k in ("kind", "started_s", "ended_s", "recovered_after_s")}
                           for e in rep.get("events", [])])
        shutil.copyfile(report / "report.md", out / f"report-{i}.md")
        walls = [json.loads(line).get("round_wall_s") for m in sorted((report / "metrics").glob("pi-*/*.jsonl"))
                 for line in m.read_text().splitlines() if line.strip()]
        walls = [w for w in walls if isinstance(w, (int, float))]
        row["round_wall_s_median"] = round(statistics.median(walls), 3) if walls else None  # every device's rounds
    if p.returncode != 0:
        (out / f"pytest-{i}.log").write_text(text[-20000:])
    shutil.rmtree(base, ignore_errors=True)
    return row


def table(doc: dict[str, Any]) -> str:
    """``timings.md``: one row per run, then the spread."""
    lines = [f"Commit {doc['commit']}{' (with uncommitted changes)' if doc['dirty'] else ''}; "
             f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores, {doc['machine']['memory_gib']} GiB; "
             f"command: `{doc['command']}`", "",
             "| run | result | pytest wall (s) | smoke lab run (s) | smoke test (s) | declined-run test (s) | "
             "rounds | round (s, median) | load before | load during (mean / max) | load after | namespaces left |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        c = r["test_call_s"]
        lines.append(f"| {r['run']} | {r['result']} | {r['pytest_wall_s']} | {r['lab_run_s']} | "
                     f"{c.get('test_the_smoke_scenario', '')} | {c.get('test_failed_checks_exit_1_naming_them', '')} | "
                     f"{r.get('rounds')} | {r.get('round_wall_s_median')} | {r['load1_before']} | {r['load1_during_mean']} / {r['load1_during_max']} | "
                     f"{r['load1_after']} | {len(r['namespaces_left'])} |")
    walls = [r["pytest_wall_s"] for r in doc["runs"]]
    lines += ["", f"pytest wall time: median {statistics.median(walls):.0f} s, range {min(walls):.0f}–{max(walls):.0f} s "
                  f"over {len(walls)} runs"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "lab" / "results" / "smoke")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("smoke_time: the field lab runs as root", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
                           "machine": machine(), "command": f"python -m pytest -q -p no:cacheprovider {TEST}",
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    for i in range(1, a.runs + 1):
        doc["runs"].append(one_run(i, a.out))
        print(json.dumps(doc["runs"][-1]), flush=True)
        (a.out / "timings.json").write_text(json.dumps(doc, indent=2) + "\n")
    (a.out / "timings.md").write_text(table(doc))
    print(table(doc))
    return 0 if all(r["exit_code"] == 0 and not r["namespaces_left"] for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
