"""The supervisor's memory over many runs: RSS of the always-on agent after each of ``--runs``
runs.

Starts mosquitto and one signed ``dfl-agent run`` (no ``[algorithm]``: it waits for runs;
``data.dataset = "store"`` fed through its spool, small MLP, deployment on without ONNX
export, mDNS off), waits until it serves, then submits ``--runs`` tiny runs with ``dflctl
run submit`` and an operator key (``local``, 1 round, ``--training steps=N``, minimum 1
member), one after the other: each is submitted when the previous one is ``finished`` in
the run ledger (``STATE/runs/ledger.json``).  The spool gets 3 files of 60 windows before
the first run and one more with each run (``--windows-per-run``), so the supervisor also ingests while runs come
and go, and deploys (or keeps out) each run's model.  After each run has finished (and
``--settle`` seconds), samples the supervisor process only (not its run process): RSS,
PSS, USS, threads, open files, and whether libtorch is in its memory maps.  Writes ``runs_memory.json``; the acceptance: the RSS after the last run within 10 %
of the RSS after the first run.

    nice -n 10 .venv/bin/python bench/operations/runs_memory.py --runs 20 --out bench/operations
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from idle import machine, memory, torch_mapped
from runs_timing import invocation, node_config, operator_dir, start_agent, submit

from dfl_agent.cli.broker import start_broker

SHAPE = (3, 16)


def drop(spool: Path, name: str, n: int, seed: int) -> None:
    """``n`` windows of a learnable toy task (the label is the channel/half with the largest
    mean) into the spool as one ``.npz``, written aside and renamed in."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, c % 3, (c // 3) * 8:(c // 3) * 8 + 8] += 2.0
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y, t=np.full(n, time.time()))
    spool.mkdir(parents=True, exist_ok=True)
    (spool / f".{name}.tmp").write_bytes(buf.getvalue())
    os.replace(spool / f".{name}.tmp", spool / name)


def store_samples(state: Path) -> int:
    """Samples in the node's store (its SQLite database, read-only)."""
    db = state / "store" / "samples.sqlite"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return int(con.execute("SELECT COUNT(*) FROM samples").fetchone()[0])


def ledger(state: Path) -> dict:
    try:
        return json.loads((state / "runs" / "ledger.json").read_text())
    except (OSError, ValueError):
        return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs, one after the other")
    p.add_argument("--steps", type=int, default=2, help="training steps of each run's one round")
    p.add_argument("--windows-per-run", type=int, default=60,
                   help="windows dropped into the spool with each run (0: none after the first 180)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after a run finished before sampling")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    p.add_argument("--out", default="bench/operations", help="folder for runs_memory.json")
    p.add_argument("--name", default="runs_memory.json", help="file name of the results in --out")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dfl-runsmem-"))
    fed, fed_key, nid, host = "runsmem", Ed25519PrivateKey.generate(), "m0", machine()
    op = operator_dir(tmp, fed_key, fed)
    state = tmp / nid
    samples: list[dict] = []
    ok = True
    with start_broker("mosquitto") as broker:
        cfg = node_config(tmp, fed_key, fed, nid, broker.endpoint,
                          f'[data]\ndataset = "store"\ninput_shape = {list(SHAPE)}\nnum_classes = 4\n'
                          'spool_interval = 0.2\n[model]\nsize = "small"\n'
                          '[training]\nepochs = 1\nbatch_size = 32\nthreads = 1\n[deploy]\nonnx = false\n'
                          '[discovery]\nmin_peers = 0\nmdns = false\n')
        for k in range(3):
            drop(state / "spool", f"a{k}.npz", 60, k)
        log = tmp / "agent.log"
        proc = start_agent(cfg, log)
        ps = psutil.Process(proc.pid)
        try:
            t_end = time.monotonic() + 120
            while "waiting for runs" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < t_end, log.read_text()[-3000:]
                time.sleep(0.1)
            before = {"run": 0, **memory(ps), "threads": ps.num_threads(), "open_files": ps.num_fds()}
            print(before, flush=True)
            for i in range(1, a.runs + 1):
                if a.windows_per_run:
                    drop(state / "spool", f"r{i}.npz", a.windows_per_run, 100 + i)
                t0 = time.monotonic()
                rid = submit(broker.endpoint, fed, op, "--algorithm", "local", "--rounds", "1", "--training",
                             f"steps={a.steps}", "--min-members", "1", "--name", f"mem-{i}")
                while ledger(state).get(rid, {}).get("state") != "finished":
                    if proc.poll() is not None or time.monotonic() - t0 > a.timeout:
                        print(log.read_text()[-3000:], file=sys.stderr)
                        ok = False
                        break
                    time.sleep(0.1)
                if not ok:
                    break
                wall = time.monotonic() - t0
                time.sleep(a.settle)
                said = [ln for ln in log.read_text().splitlines() if f"(run {rid}," in ln and "dfl_agent.deploy" in ln]
                samples.append({"run": i, "run_id": rid, "reason": ledger(state)[rid].get("reason", ""),
                                "deployment": said[-1].split(": ", 1)[1].split(" (run ")[0] if said else "",
                                "run_wall_s": round(wall, 1),
                                **{k: round(v, 2) for k, v in memory(ps).items()}, "threads": ps.num_threads(),
                                "open_files": ps.num_fds(), "children": len(ps.children()),
                                "torch_mapped": torch_mapped(proc.pid)})
                print(samples[-1], flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    text = log.read_text()
    rss = [s["rss_mb"] for s in samples]
    growth = (rss[-1] - rss[0]) / rss[0] if rss else None
    res = {"command": invocation(), "machine": host, "runs": len(samples), "steps": a.steps,
           "windows_per_run": a.windows_per_run,
           "deployed": text.count("deployed model v"), "store_samples": store_samples(state),
           "before_first_run": before,
           "rss_mb_after_first": rss[0] if rss else None, "rss_mb_after_last": rss[-1] if rss else None,
           "rss_mb_max": max(rss) if rss else None,
           "rss_growth_first_to_last": None if growth is None else round(growth, 4),
           "target": "RSS after the last run within 10 % of the RSS after the first run",
           "within_target": ok and growth is not None and abs(growth) <= 0.10 and len(samples) == a.runs,
           "torch_mapped": sorted({f for s in samples for f in s["torch_mapped"]}), "samples": samples}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / a.name).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    return 0 if res["within_target"] and not res["torch_mapped"] else 1


if __name__ == "__main__":
    sys.exit(main())
