"""The README's demo, run several times one after the other: its accuracy and wall time with their
spread, and the conditions of each run (commit, load), written to ``bench/results/demo_runs.md``
and ``demo_runs.json``.

    nice -n 10 .venv/bin/python bench/demo_runs.py --runs 3
    nice -n 10 .venv/bin/python bench/demo_runs.py --runs 3 --name demo_runs_fedavg -- --algorithm fedavg

Each run is ``dflctl demo --no-live --out DIR`` (DFML, five different CNNs, 5 agent processes,
20 rounds, the default seed), the command the README shows, with the options after ``--``; its ``summary.json`` gives the
held-out accuracy of the federated models and of the same models trained alone, each the mean
over the 5 nodes. The demo's agents are real processes over a real broker, so the rounds'
timing, and with it which updates each aggregation sees, differ between runs: the spread is
what a user should expect on a machine like this one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def one_run(dflctl: str, out: Path, extra: list[str]) -> dict:
    """One demo: its summary's accuracies, wall and CPU seconds, load before and after."""
    before_load, t0 = load(), time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([dflctl, "demo", "--no-live", "--out", str(out), *extra], capture_output=True, text=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic() - t0
    row = {"started": started, "exit_code": proc.returncode, "wall_s": round(wall, 1),
           "cpu_s": round((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), 1),
           "load_before": before_load, "load_after": load()}
    try:
        s = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        row["error"] = proc.stderr[-1500:]
        return row
    row |= {"federated": round(s["global_accuracy"]["mean"], 4), "alone": round(s["local_only_global_accuracy"]["mean"], 4),
            "federated_per_node": s["global_accuracy"]["per_node"], "rounds_per_node": s["rounds_per_node"],
            "summary_wall_s": round(s["wall_seconds"], 1), "algorithm": s["algorithm"]}
    return row


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.mean(values), 4), "min": min(values), "max": max(values),
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dflctl", default=str(Path(sys.executable).parent / "dflctl"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder of demo_runs.md/.json")
    p.add_argument("--name", default="demo_runs", help="file name (without suffix) of the results in --out")
    p.add_argument("--render", type=Path, metavar="JSON", help="only write the Markdown again from a results file")
    p.add_argument("extra", nargs="*", help="more options for dflctl demo (after --)")
    a = p.parse_args()
    if a.render:
        res = json.loads(a.render.read_text())
        return 0 if render(res, a.out, a.name) == len(res["runs"]) else 1
    niceness = os.nice(0)
    cmd = (f"nice -n {niceness} " if niceness else "") + shlex.join(
        [os.path.relpath(sys.executable, ROOT), "bench/demo_runs.py", *sys.argv[1:]])
    head = {"command": cmd, "commit": commit(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, Python {platform.python_version()}",
            "demo": shlex.join(["dflctl", "demo", "--no-live", "--out", "DIR", *a.extra])}
    rows = []
    for i in range(a.runs):
        tmp = Path(tempfile.mkdtemp(prefix="dfl-demo-runs-"))
        row = one_run(a.dflctl, tmp / "out", a.extra)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("federated_per_node", "rounds_per_node")}),
              flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    res = {**head, "runs": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    ok = render(res, a.out, a.name)
    return 0 if ok == len(rows) else 1


def render(res: dict, out: Path, name: str = "demo_runs") -> int:
    """Write ``NAME.json`` and ``NAME.md`` in ``out`` from the results; the number of runs that
    succeeded (their spread is added to the results)."""
    rows = res["runs"]
    ok = [r for r in rows if "federated" in r and r["exit_code"] == 0]
    if ok:
        res["spread"] = {k: spread([r[k] for r in ok]) for k in ("federated", "alone", "wall_s")}
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = [f"# The demo{' (' + res['demo'].split('DIR ', 1)[1] + ')' if 'DIR ' in res['demo'] else ''}, run several times", "",
          f"Generated by `{res['command']}` at commit {res['commit']} on {res['machine']} (a VM shared with",
          "other sessions' work: the load average is the machine's, before and after each run). Each run",
          f"is `{res['demo']}`; accuracy is the mean over the 5 nodes on 9 held-out users.", "",
          "| run | started | load before → after | wall time | CPU (user + system) | federated | alone |",
          "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        acc = (f"{100 * r['federated']:.1f} % | {100 * r['alone']:.1f} %" if "federated" in r
               else f"failed (exit {r['exit_code']}) | |")
        md.append(f"| {i} | {r['started']} | {r['load_before']} → {r['load_after']} | {r['wall_s']:.0f} s | "
                  f"{r['cpu_s']:.0f} s | {acc} |")
    if ok:
        f, al, w = res["spread"]["federated"], res["spread"]["alone"], res["spread"]["wall_s"]
        md += ["", f"Over the {len(ok)} runs: federated {100 * f['min']:.1f}–{100 * f['max']:.1f} % (mean "
               f"{100 * f['mean']:.1f} %, sd {100 * f['sd']:.1f} points), alone {100 * al['min']:.1f}–"
               f"{100 * al['max']:.1f} % (mean {100 * al['mean']:.1f} %), wall time {w['min']:.0f}–{w['max']:.0f} s."]
        if len(ok) > 1 and all(r["federated_per_node"] == ok[0]["federated_per_node"] for r in ok):
            md += ["", "Every run gave the same accuracies, node by node: the demo runs the papers' lock step",
                   "(`--straggler paper`, its default) with seed 0, so each round aggregates the same updates",
                   "whatever the load; only the time varies with the load."]
    if res.get("note"):
        md += ["", f"Note: {res['note']}."]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return len(ok)


if __name__ == "__main__":
    sys.exit(main())
