"""The privacy ledger's size on disk and the cost of its checks (``agent/runtime/shared/privacy_ledger.py``).

    .venv/bin/python bench/privacy/ledger.py --out bench/privacy/results/ledger.md

Two parts, each on a fresh state folder under the system's temporary folder:

* **Real writes**: ``--runs`` DP runs (default 300) through the ledger's own API, as the run manager
  makes them (``reserve``, ``mark_trained``, ``settle``: three transactions and three head-marker
  writes per run, each fsynced), timed per change; the same on release 0.1.0's ledger (commit
  75535c2, its ``privacy_budget.py`` taken with ``git show``) in the same process, alternating, for
  the ratio.
* **A long life**: 1,000 and 10,000 settled runs appended in one transaction (the same events and
  rows the API writes), then the file's size per run and the time of a full check (a new
  ``PrivacyLedger``'s ``state()``: integrity check, hash chain, fold, table ``runs``; three repeats,
  median), which the agent pays at start and at every admission: the size a ledger would reach
  without folding.
* **Folded** (the service's steady state): ``--folded`` DP runs (default 600), each with its own
  noise multiplier and sampling rate (as a device recalibrates them to its growing store), through the API with
  :meth:`PrivacyLedger.fold` after each settled run, as the service calls it
  (``runtime.keep_runs`` = 20); the ``privacy/`` folder's bytes (database, journal, shared memory)
  every 100 runs, and the composed ε against the same history unfolded.

Timings depend on the machine's load (written into the report); sizes do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _plan():
    from dfl_agent.privacy.plan import RunPlan

    return RunPlan(noise_multiplier=1.1, sample_rate=0.02, steps=400, epsilon=1.0, delta=1e-5, max_grad_norm=1.0)


def _old_ledger_class(tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", "75535c2:agent/runtime/privacy_budget.py"], check=True,
                         capture_output=True, text=True).stdout
    path = tmp / "privacy_budget_75535c2.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("privacy_budget_75535c2", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PrivacyLedger


def real_writes(runs: int, tmp: Path) -> dict[str, float]:
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

    old_cls = _old_ledger_class(tmp)
    plan = _plan()
    ledgers = {"new": PrivacyLedger(tmp / "new"), "old": old_cls(tmp / "old")}
    times: dict[str, list[float]] = {"new": [], "old": []}
    for i in range(runs):
        for name in ("new", "old") if i % 2 == 0 else ("old", "new"):
            led = ledgers[name]
            for op in (lambda: led.reserve(f"r{i}", plan, 10), lambda: led.mark_trained(f"r{i}"),
                       lambda: led.settle(f"r{i}", 400)):
                t = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - t)
    size = (tmp / "new" / "privacy" / "ledger.sqlite").stat().st_size
    size_old = (tmp / "old" / "privacy" / "ledger.sqlite").stat().st_size
    return {"runs": runs, "write_ms": 1000 * statistics.median(times["new"]),
            "write_ms_old": 1000 * statistics.median(times["old"]), "bytes_per_run": size / runs,
            "bytes_per_run_old": size_old / runs}


def long_life(runs: int, tmp: Path) -> dict[str, float]:
    from dfl_agent.runtime.shared.privacy_chain import LedgerState, write_head
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

    d = tmp / f"life-{runs}"
    led = PrivacyLedger(d)
    chain = secrets.token_hex(16)
    led._create(chain)
    con = led._connect()
    con.execute("BEGIN IMMEDIATE")
    st = LedgerState(chain=chain, head=chain)
    plan = {"noise_multiplier": 1.1, "sample_rate": 0.02, "steps": 400, "planned_steps": 400, "steps_per_round": 40,
            "delta": 1e-5, "max_grad_norm": 1.0, "epsilon": 1.0}
    for i in range(runs):
        rid = f"d-{secrets.token_hex(6)}.{i}"
        led._append(con, st, rid, "reserve", {**plan, "time": 1.7e9 + 3600 * i})
        led._append(con, st, rid, "trained", {})
        led._append(con, st, rid, "settle", {"state": "spent", "steps": 400, "epsilon": 1.0,
                                             "settled": 1.7e9 + 3600 * i + 600})
    con.execute("COMMIT")
    con.close()
    write_head(d, st)
    checks = []
    for _ in range(3):
        t = time.perf_counter()
        assert PrivacyLedger(d).state().events == 3 * runs
        checks.append(time.perf_counter() - t)
    size = (d / "privacy" / "ledger.sqlite").stat().st_size
    return {"runs": runs, "bytes_per_run": size / runs, "file_kib": size / 1024, "check_s": statistics.median(checks)}


def folded_life(runs: int, keep: int, tmp: Path) -> dict:
    import dataclasses

    from dfl_agent.privacy.accountant import rdp_epsilon
    from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger

    d = tmp / "folded"
    led = PrivacyLedger(d)
    plan = _plan()
    sizes, history = [], []
    for i in range(runs):  # each run its own noise multiplier and sampling rate (a device's growing store)
        run_plan = dataclasses.replace(plan, noise_multiplier=plan.noise_multiplier * (1 + 0.01 * (i % 13)),
                                       sample_rate=plan.sample_rate * (1 - 0.003 * (i % 17)))
        history.append((run_plan.noise_multiplier, run_plan.sample_rate, 400))
        led.reserve(f"r{i}", run_plan, 10)
        led.mark_trained(f"r{i}")
        led.settle(f"r{i}", 400)
        led.fold(keep)
        if (i + 1) % 100 == 0:
            sizes.append((i + 1, sum(f.stat().st_size for f in (d / "privacy").iterdir())))
    eps = PrivacyLedger(d).epsilon(plan.delta)
    unfolded = rdp_epsilon(history, plan.delta)
    return {"runs": runs, "keep": keep, "sizes": sizes, "epsilon": eps, "epsilon_unfolded": unfolded,
            "rows": len(PrivacyLedger(d).state().rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300, help="DP runs written through the API (real writes)")
    ap.add_argument("--folded", type=int, default=600, help="DP runs written with folding (the service's way)")
    ap.add_argument("--out", default=None, help="write the report (markdown) here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    try:
        load0 = os.getloadavg()
        real = real_writes(a.runs, tmp)
        lives = [long_life(n, tmp) for n in (1000, 10000)]
        folded = folded_life(a.folded, 20, tmp)
        load1 = os.getloadavg()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# The privacy ledger: size and checks",
        "",
        f"    .venv/bin/python bench/privacy/ledger.py --runs {a.runs} --folded {a.folded} "
        "--out bench/privacy/results/ledger.md",
        "",
        f"Commit {commit} (the working tree it ran in), {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, SQLite {__import__('sqlite3').sqlite_version}; load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after (other jobs on the machine). The script's docstring says "
        "what each part does.",
        "",
        f"## Real writes ({real['runs']} DP runs, 3 changes each, alternating with 0.1.0's ledger)",
        "",
        "| ledger | median time of one change | bytes per run |",
        "|---|---|---|",
        f"| chained (this release) | {real['write_ms']:.1f} ms | {real['bytes_per_run']:.0f} |",
        f"| 0.1.0 (commit 75535c2) | {real['write_ms_old']:.1f} ms | {real['bytes_per_run_old']:.0f} |",
        "",
        "A change of the chained ledger is one SQLite transaction (synchronous = FULL) plus the head "
        "marker's atomic write (two more fsyncs).",
        "",
        "## A long life without folding (settled runs written in one transaction)",
        "",
        "| DP runs | file | bytes per run | full check (median of 3) |",
        "|---|---|---|---|",
        *[f"| {x['runs']:,} | {x['file_kib']:.0f} KiB | {x['bytes_per_run']:.0f} | {x['check_s']:.2f} s |"
          for x in lives],
        "",
        "The full check runs at start and at every admission; the status heartbeat and the writes "
        "reuse it while the files' size, time and inode stay the same.",
        "",
        f"## Folded, as the service keeps it ({folded['runs']} DP runs, `runtime.keep_runs` = {folded['keep']})",
        "",
        "| DP runs | `privacy/` folder |",
        "|---|---|",
        *[f"| {n:,} | {b / 1024:.0f} KiB |" for n, b in folded["sizes"]],
        "",
        f"After {folded['runs']} runs the ledger holds {folded['rows']} rows; composed epsilon "
        f"{folded['epsilon']:.9g}, against {folded['epsilon_unfolded']:.9g} for the same history unfolded.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
