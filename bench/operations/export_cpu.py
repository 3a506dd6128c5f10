"""CPU time of ``dflctl export`` against ``python -c 'import torch'``, paired run by run.

Runs the two commands in turn (export, import, export, import, ...) ``--n`` times after one
warm-up pair, and takes each process's user + system CPU seconds from the operating system's
accounting of the finished child (``os.wait4``). Each export is divided by the ``import torch``
run right after it, so that a change in the machine's load hits both; the ratio is reported as
the median, minimum and maximum of those pairs, with the CPU seconds, wall seconds and peak RSS
of each command.

The export is the small HAR model, freshly initialised, with the command's default check
(onnxruntime against torch on 256 test windows) and its torch test accuracy:
``python -m dfl_agent.cli.dflctl export --onnx <tmp>/m.onnx --model-size small``.
``--pythonpath DIR`` runs both commands with ``PYTHONPATH=DIR`` (an older ``dfl_agent``
package laid out as installed, to measure it on the same machine).

Usage (repository root)::

    python bench/operations/export_cpu.py --n 10 --label LABEL --out bench/operations/export_cpu.jsonl
    python bench/operations/export_cpu.py --report bench/operations/export_cpu.jsonl > bench/operations/export_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_child(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run ``cmd`` to its end (output discarded): its CPU seconds (user + system), wall
    seconds and peak RSS (MB), from ``os.wait4``.

    Raises:
        RuntimeError: the command failed (its exit status and the end of its output).
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}: {out[-400:].decode(errors='replace')}")
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "wall_s": wall,
            "peak_rss_mb": ru.ru_maxrss / 1024}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _machine() -> str:
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()} {model}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10, help="pairs measured (after one warm-up pair)")
    p.add_argument("--pythonpath", default=None, help="PYTHONPATH of both commands (an older package)")
    p.add_argument("--label", default="run")
    p.add_argument("--out", default=None, help="append the record as one JSON line to this file")
    p.add_argument("--report", default=None, help="print the Markdown report of a results file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    env = dict(os.environ)
    if a.pythonpath:
        env["PYTHONPATH"] = a.pythonpath
    with tempfile.TemporaryDirectory() as tmp:
        export = [sys.executable, "-m", "dfl_agent.cli.dflctl", "export", "--onnx", f"{tmp}/m.onnx",
                  "--model-size", "small"]
        torch_only = [sys.executable, "-c", "import torch"]
        load_before = list(os.getloadavg())
        runs: dict[str, list[dict[str, float]]] = {"export": [], "import_torch": []}
        for i in range(a.n + 1):
            e = run_child(export, env)
            t = run_child(torch_only, env)
            if i:  # the first pair warms the file cache
                runs["export"].append(e)
                runs["import_torch"].append(t)
        load_after = list(os.getloadavg())
    ratios = [e["cpu_s"] / t["cpu_s"] for e, t in zip(runs["export"], runs["import_torch"], strict=True)]
    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    record: dict[str, Any] = {
        "label": a.label, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
        "machine": _machine(), "pythonpath": a.pythonpath, "n": a.n,
        "command": shlex.join([exe, *(sys.argv if argv is None else ["bench/operations/export_cpu.py", *argv])]),
        "export_command": "python -m dfl_agent.cli.dflctl export --onnx <tmp>/m.onnx --model-size small",
        "baseline_command": "python -c 'import torch'", "load_before": load_before, "load_after": load_after,
        "ratio_cpu": _summary(ratios), "ratios": ratios,
        **{name: {k: _summary([r[k] for r in rs]) for k in ("cpu_s", "wall_s", "peak_rss_mb")}
           for name, rs in runs.items()},
    }
    print(json.dumps(record, indent=1))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


def report(path: Path) -> str:
    """Markdown table of every run in the JSON-lines file ``path``."""
    lines = ["# `dflctl export` against `import torch`: CPU seconds, paired run by run", "",
             "Export: `python -m dfl_agent.cli.dflctl export --onnx <tmp>/m.onnx --model-size small` (the small "
             "HAR model, initial weights, the onnxruntime check on 256 test windows). Baseline: "
             "`python -c 'import torch'`. The two run in turn; each ratio is an export's CPU seconds (user + "
             "system) over those of the `import torch` run after it. How to run: `bench/operations/README.md`.", "",
             "| run | commit | export CPU s (median, min-max) | import torch CPU s | ratio: median | min | max | "
             "export peak RSS MB | load average before / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        e, t, q = r["export"]["cpu_s"], r["import_torch"]["cpu_s"], r["ratio_cpu"]
        lines.append(f"| {r['label']} | `{r['commit']}` | {e['median']:.2f} ({e['min']:.2f}-{e['max']:.2f}) | "
                     f"{t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | {q['median']:.2f}x | {q['min']:.2f}x | "
                     f"{q['max']:.2f}x | {r['export']['peak_rss_mb']['median']:.0f} | "
                     f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f} |")
        notes.append(f"- {r['label']} ({r['time']}, {r['n']} pairs, {r['machine']}): `{r['command']}`"
                     + (f" (PYTHONPATH={r['pythonpath']})" if r.get("pythonpath") else ""))
    return "\n".join(lines + ["", "Commands:", "", *notes, ""])


if __name__ == "__main__":
    raise SystemExit(main())
