"""Simulator scale benchmark: wall time, peak RSS and node-rounds/s against the node count.

Each cell is one ``dflctl simulate`` process measured with GNU time (``/usr/bin/time -v``:
peak RSS = "Maximum resident set size").  Results are appended to ``results.jsonl``
(one JSON object per cell); ``python bench/scale/run.py --report`` writes ``results.md``
with the fitted growth exponent of peak RSS (least squares of log RSS on log N).

Usage (from the repository root; the machine is shared, so run it with nice)::

    nice -n 10 python bench/scale/run.py --nodes 10 100 300 1000 --topology full
    nice -n 10 python bench/scale/run.py --nodes 100 300 1000 --topology erdos_renyi
    nice -n 10 python bench/scale/run.py --nodes 1000 --topology k_regular --topology-option k=4 \
        --rounds 2 --extra "--samples-per-node 16"
    python bench/scale/run.py --report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def record(cell: dict, results: Path, label: str = "") -> dict:
    """Label ``cell`` (when ``label``), print it and append it to ``results`` (one JSON line)."""
    if label:
        cell["label"] = label
    print(json.dumps(cell), flush=True)
    with open(results, "a") as f:
        f.write(json.dumps(cell) + "\n")
    return cell


def run_cell(nodes: int, topology: str, algorithm: str, rounds: int, extra: list[str], timeout: int = 0,
             topology_options: list[str] | None = None, rss_limit_mb: float = 0,
             pythonpath: str | None = None, commit: str | None = None) -> dict:
    """Run one simulation; returns its measured cell (wall s, peak RSS MB, node-rounds/s),
    with the machine and its load average before and after.

    ``topology_options``: ``KEY=VALUE`` items (default ``p=0.05`` for ``erdos_renyi``).
    ``rss_limit_mb``: stop the run (``rc`` -9, ``stopped`` = ``rss_limit``) once the
    simulation's resident memory exceeds this (0: no limit).  ``pythonpath``: run another
    copy of the package (laid out as installed) whose ``commit`` is recorded."""
    dflctl = shutil.which("dflctl") or str(Path(sys.executable).parent / "dflctl")
    cmd = [dflctl, "simulate", "--algorithm", algorithm, "--dataset", "digits", "--partition", "iid",
           "--rounds", str(rounds), "--nodes", str(nodes)]
    if topology != "full":
        cmd += ["--topology", topology]
        if topology_options is None and topology == "erdos_renyi":
            topology_options = ["p=0.05"]
        for option in topology_options or []:
            cmd += ["--topology-option", option]
    cmd += extra
    commit = commit or _code_commit()
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    load_before = os.getloadavg()
    t0 = time.time()
    # the child's per-round progress lines (stderr, no terminal) are passed on as they come
    limit = ["timeout", str(timeout)] if timeout else []  # exit 124 when it runs out
    p = subprocess.Popen(["/usr/bin/time", "-v", *limit, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None and p.stderr is not None
    stopped: list[str] = []
    if rss_limit_mb:
        threading.Thread(target=_watch_rss, args=(p.pid, rss_limit_mb, stopped), daemon=True).start()
    err_lines = []
    for line in p.stderr:
        err_lines.append(line)
        if ": round " in line:
            print(f"  {nodes} nodes | {line.rstrip()}", file=sys.stderr, flush=True)
    stdout = p.stdout.read()
    rc = p.wait()
    wall = time.time() - t0
    err = "".join(err_lines)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    rss_kb = int(rss.group(1)) if rss else 0
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([0-9.]+)", err))
    acc = re.search(r"global accuracy ([0-9.]+)", stdout)
    cell = {"algorithm": algorithm, "nodes": nodes, "commit": commit, "topology": topology, "rounds": rounds,
            "extra": extra, "rc": rc, "wall_s": round(wall, 1), "peak_rss_mb": round(rss_kb / 1024, 1),
            "node_rounds_per_s": round(nodes * rounds / wall, 2),
            # user + system CPU seconds of the process: on a shared machine the comparable figure
            "cpu_s": round(cpu, 1), "node_rounds_per_cpu_s": round(nodes * rounds / cpu, 2) if cpu else None,
            "global_accuracy": float(acc.group(1)) if acc else None,
            "command": " ".join(["dflctl", *cmd[1:]]),
            "machine": machine(), "load_before": [round(v, 2) for v in load_before],
            "load_after": [round(v, 2) for v in os.getloadavg()]}
    if topology_options:
        cell["topology_options"] = list(topology_options)
    if stopped:
        cell["stopped"] = stopped[0]
    return cell


def machine() -> str:
    """``"x86_64, 2 cores, 23.4 GB, Linux 6.1, Python 3.11.7"``: what a cell ran on."""
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem:.1f} GB, {platform.system()} "
            f"{platform.release().split('-')[0]}, Python {platform.python_version()}")


def _watch_rss(pid: int, limit_mb: float, stopped: list[str]) -> None:
    """Kill the processes under ``pid`` (GNU time, timeout, the simulation) once their
    summed resident memory passes ``limit_mb``; ``stopped`` gets ``"rss_limit"``."""
    import psutil

    try:
        root = psutil.Process(pid)
        while root.is_running() and root.status() != psutil.STATUS_ZOMBIE:
            procs = root.children(recursive=True)
            rss = sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20
            if rss > limit_mb:
                stopped.append("rss_limit")
                for q in procs:
                    q.kill()
                return
            time.sleep(0.2)
    except psutil.Error:
        return


def _code_commit() -> str | None:
    """Short commit of the checkout whose ``dfl_agent`` this Python runs (None: unknown)."""
    try:
        import dfl_agent

        out = subprocess.run(["git", "-C", str(Path(dfl_agent.__file__).resolve().parent), "rev-parse", "--short",
                              "HEAD"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - best effort
        return None


def exponent(cells: list[dict], lo: int = 100, hi: int = 1000) -> float | None:
    """Slope of log(peak RSS) on log(N) over cells with ``lo <= N <= hi`` (None: fewer than two
    node counts)."""
    pts = [(math.log(c["nodes"]), math.log(c["peak_rss_mb"])) for c in cells if lo <= c["nodes"] <= hi and c["rc"] == 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def report() -> None:
    cells = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    lines = ["# Simulator scale (generated by `python bench/scale/run.py --report`)", "",
             "| algorithm | topology | nodes | rounds | wall s | CPU s | peak RSS MB | node-rounds/s | "
             "node-rounds per CPU s | global acc | rc | code |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c["algorithm"], _topology(c), " ".join(c["extra"]), c.get("label", ""),
                                          c["nodes"])):
        lines.append(f"| {c['algorithm']} {' '.join(c['extra'])}{_label(c)} | {_topology(c)} | {c['nodes']} | {c['rounds']} | "
                     f"{c['wall_s']} | {c.get('cpu_s', '-')} | {c['peak_rss_mb']} | {c['node_rounds_per_s']} | "
                     f"{c.get('node_rounds_per_cpu_s', '-')} | {c['global_accuracy']} | {c['rc']} | "
                     f"{c.get('commit', '-')} |")
    lines.append("")
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["algorithm"], _topology(c), " ".join(c["extra"]), c.get("label", "")), []).append(c)
    for key, cs in sorted(groups.items()):
        e = exponent(cs)
        if e is not None:
            lines.append(f"- peak-RSS growth exponent over 100-1000 nodes, {' '.join(k for k in key if k)}: **{e:.2f}**")
    notes = [f"- `{c['commit']}`{_label(c)}, {c['nodes']} nodes {c['topology']}: {c['note']}"
             for c in cells if c.get("note")]
    lines += ["", "rc 124: stopped by `--timeout`; rc 2: the simulation refused its arguments (for example no connected "
              "Erdős–Rényi graph at 10 nodes with p = 0.05).", *notes,
              "", "Commands: the `command` field of each line of `results.jsonl`."]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _topology(cell: dict) -> str:
    """The cell's topology with its options when they are not the default ``p=0.05``."""
    opts = cell.get("topology_options") or []
    return " ".join([cell["topology"], *(o for o in opts if o != "p=0.05")])


def _label(cell: dict) -> str:
    """The cell's series label, as shown after the algorithm (empty without one)."""
    return f" [{cell['label']}]" if cell.get("label") else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[10, 100, 300, 1000], help="node counts")
    ap.add_argument("--topology", default="full", help="full, erdos_renyi (p = 0.05 unless --topology-option), "
                    "k_regular, ...")
    ap.add_argument("--topology-option", action="append", default=None, metavar="KEY=VALUE",
                    help="topology option (repeatable), passed to dflctl simulate")
    ap.add_argument("--algorithm", default="fedavg", help="algorithm")
    ap.add_argument("--rounds", type=int, default=3, help="rounds")
    ap.add_argument("--extra", default="", help="further dflctl simulate arguments, space separated")
    ap.add_argument("--report", action="store_true", help="only write results.md from results.jsonl")
    ap.add_argument("--timeout", type=int, default=0, help="seconds before a cell is stopped (rc 124); 0: none")
    ap.add_argument("--label", default="", help="series label of the cells (a separate row and exponent)")
    ap.add_argument("--note", default="", help="a note on the cells, listed under the table")
    ap.add_argument("--pythonpath", default=None, help="run another copy of the package (laid out as installed, "
                    "e.g. by regression.py) through PYTHONPATH")
    ap.add_argument("--commit", default=None, help="with --pythonpath: the commit of that package, recorded")
    a = ap.parse_args()
    if a.report:
        report()
        return
    for n in a.nodes:
        cell = run_cell(n, a.topology, a.algorithm, a.rounds, a.extra.split(), a.timeout, a.topology_option,
                        pythonpath=a.pythonpath, commit=a.commit)
        if a.label:
            cell["label"] = a.label
        if a.note:
            cell["note"] = a.note
        print(json.dumps(cell), flush=True)
        with open(HERE / "results.jsonl", "a") as f:
            f.write(json.dumps(cell) + "\n")


if __name__ == "__main__":
    main()
