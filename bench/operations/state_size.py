"""The state directory's steady-state size per model size, and the run ledger's size per run.

**Agents.**  For each model (an MLP spec per size: about 25 kB, 0.7 MB and 9 MB of float32
weights), starts mosquitto and one always-on ``dfl-agent run`` on a sample store (a seed file of
400 samples of shape [3, 32], 4 classes) whose ``[algorithm]`` run recurs every ``--every``
seconds (fedavg, 2 rounds, ``runtime.keep_runs = --keep-runs``, ``deploy.keep`` 3, ONNX export
off), lets ``--runs`` runs end, and after each records the bytes of every part of the state
directory (``store``, ``models``, ``runs``, ``privacy``, other: the files' sizes, as ``dflctl
doctor`` shows them) and of one ended run's folder, and the largest bytes a run's checkpoints
took while it trained (sampled every 0.2 s).

**Ledger.**  Records ``--ledger-runs`` ended runs in a run ledger (entries as a recurring run
leaves them), keeps 20 whole, and measures the file's bytes per run.

Writes ``state_size.json`` (the command, commit, machine and load, every sample) and prints the
per-size summary; the steady state with the defaults is ``store + 3 versions + keep_runs x one
ended run's folder + the ledger``.

    nice -n 10 .venv/bin/python bench/operations/state_size.py --out bench/operations
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from idle import commit, machine
from runs_timing import invocation, start_agent

from dfl_agent.cli.broker import start_broker
from dfl_agent.runtime.service.ledger import RunLedger, read_entries
from dfl_agent.runtime.service.retention import usage
from dfl_agent.runtime.shared.descriptor import TERMINAL

SIZES = {"25 kB": [64], "0.7 MB": [512, 256], "9 MB": [2048, 1024]}


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def measure(size: str, hidden: list[int], a: argparse.Namespace, tmp: Path) -> dict:
    state = tmp / size.replace(" ", "")
    seed = tmp / f"seed-{size.replace(' ', '')}"
    seed.mkdir()
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    np.savez(buf, x=rng.normal(size=(400, 3, 32)).astype(np.float32), y=rng.integers(0, 4, 400))
    (seed / "train.npz").write_bytes(buf.getvalue())
    spec = {"type": "mlp", "input_shape": [3, 32], "hidden": hidden, "num_classes": 4}
    with start_broker("mosquitto") as broker:
        cfg = tmp / f"{size.replace(' ', '')}.toml"
        cfg.write_text(f'federation = "size"\nnode_id = "s0"\nstate_dir = "{state}"\n'
                       f'[data]\ndataset = "store"\ninput_shape = [3, 32]\nnum_classes = 4\npath = "{seed}"\n'
                       f'spool_interval = 1.0\n[model]\nspec = {{type = "mlp", input_shape = [3, 32], hidden = {hidden}, '
                       f'num_classes = 4}}\n[training]\nsteps = 3\n'
                       f'[algorithm]\nname = "fedavg"\nrounds = 2\nevery = "{a.every}s"\n'
                       f'[deploy]\nmin_validation = 5\ntolerance = 1.0\nonnx = false\n'
                       f'[runtime]\nkeep_runs = {a.keep_runs}\n[discovery]\nmdns = false\n'
                       f'[mqtt]\nbroker = "{broker.endpoint}"\n')
        proc = start_agent(cfg, tmp / f"{size.replace(' ', '')}.log")
        peak = {"checkpoints": 0}
        stop = threading.Event()

        def sample_checkpoints() -> None:
            while not stop.is_set():
                for ck in (state / "runs").glob("*/checkpoints"):
                    try:
                        peak["checkpoints"] = max(peak["checkpoints"], folder_bytes(ck))
                    except OSError:
                        pass
                time.sleep(0.2)

        threading.Thread(target=sample_checkpoints, daemon=True).start()
        samples, seen = [], 0
        deadline = time.monotonic() + a.runs * (a.every + 60)
        try:
            while seen < a.runs and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(1.0)
                ended = [r for r, e in read_entries(state).items() if e.get("state") in TERMINAL]
                if len(ended) > seen:
                    seen = len(ended)
                    time.sleep(0.5)  # the ended run's folder settled after its ledger write
                    folders = sorted(p for p in (state / "runs").iterdir() if p.is_dir() and not p.name.startswith("."))
                    samples.append({"runs_ended": seen, **usage(state), "run_folders": len(folders),
                                    "ended_folder_bytes": folder_bytes(folders[0]) if folders else 0,
                                    "ledger_bytes": sum(f.stat().st_size for f in (state / "runs").glob("ledger.sqlite*")),
                                    "version_bytes": folder_bytes(next((state / "models").glob("v*")))
                                    if (state / "models").is_dir() and any((state / "models").glob("v*")) else 0})
                    print(size, json.dumps(samples[-1]), flush=True)
        finally:
            stop.set()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    last = samples[-1] if samples else {}
    return {"model": size, "spec": spec, "samples": samples, "checkpoints_peak_bytes": peak["checkpoints"],
            "store_bytes": last.get("store", 0), "version_bytes": last.get("version_bytes", 0),
            "ended_folder_bytes": last.get("ended_folder_bytes", 0),
            "steady_state_bytes_keep_runs_20": last.get("store", 0) + 3 * last.get("version_bytes", 0)
            + 20 * last.get("ended_folder_bytes", 0) + last.get("ledger_bytes", 0) + last.get("other", 0)
            + last.get("privacy", 0)}


def ledger_per_run(n: int, tmp: Path) -> dict:
    led = RunLedger(tmp / "ledger")
    entry = {"snapshot_last_id": 123456, "peak_rss_mb": 352.3, "init": "deployed", "started_from": 41,
             "init_reason": "", "degraded": False, "rounds_alone": 0, "exchange_rounds": 20}
    sizes = []
    for i in range(n):
        rid = f"d-22eb5281544f.{119745980 + i}"
        for state in ("admitted", "training", "trained", "deploying", "deployed"):
            led.set(rid, state, 20 if state != "admitted" else 0, "", entry)
        led.set(rid, "finished", 20, "", entry)
        led.compact_older(20)
        led.checkpoint()  # as the service's retention does after each run
        if (i + 1) % max(1, n // 10) == 0:
            sizes.append({"runs": i + 1, "bytes": (tmp / "ledger" / "runs" / "ledger.sqlite").stat().st_size})
    led.close()
    per_run = (sizes[-1]["bytes"] - sizes[0]["bytes"]) / (sizes[-1]["runs"] - sizes[0]["runs"]) if len(sizes) > 1 else 0
    return {"runs": n, "kept_whole": 20, "sizes": sizes, "bytes_per_run": round(per_run, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=6, help="runs to let end per model size")
    p.add_argument("--every", type=float, default=25.0, help="the recurring run's period (s)")
    p.add_argument("--keep-runs", type=int, default=3, help="runtime.keep_runs of the agents")
    p.add_argument("--ledger-runs", type=int, default=2000, help="runs recorded in the ledger measurement")
    p.add_argument("--sizes", default=",".join(SIZES), help="model sizes to measure (comma-separated)")
    p.add_argument("--out", default="bench/operations", help="folder for state_size.json")
    p.add_argument("--keep-tmp", action="store_true", help="keep the agents' state directories and logs")
    a = p.parse_args()
    host, at = machine(), commit()  # the code measured: its commit when the measurement starts
    tmp = Path(tempfile.mkdtemp(prefix="dfl-state-size-"))
    try:
        ledger = ledger_per_run(a.ledger_runs, tmp)
        print("ledger", json.dumps(ledger), flush=True)
        models = [measure(s, SIZES[s], a, tmp) for s in a.sizes.split(",")]
    finally:
        if not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res = {"command": invocation(), "commit": at, "machine": host,
           "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()), "keep_runs": a.keep_runs,
           "ledger": ledger, "models": models}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_size.json").write_text(json.dumps(res, indent=1))
    for m in models:
        print(f"{m['model']}: version {m['version_bytes']} B, ended run folder {m['ended_folder_bytes']} B, checkpoints "
              f"while training {m['checkpoints_peak_bytes']} B, store {m['store_bytes']} B, steady state (keep_runs 20) "
              f"{m['steady_state_bytes_keep_runs_20']} B")
    print(f"ledger: {ledger['bytes_per_run']} B per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
