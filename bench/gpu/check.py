"""The measurements of ``scripts/gpu_check.sh`` (parts 2-4): simulator speed and accuracy on
CUDA against cpu, the batched training step on CUDA against the per-node loop on CUDA,
and a two-agent federation over a local amqtt broker, one agent on CUDA, one on cpu.

    python bench/gpu/check.py OUTDIR [--parts simulate,batch,federation] [--device auto|cpu|cuda]

Writes ``OUTDIR/results.json`` (every number) and ``OUTDIR/summary.md`` (the table the
script's output shows).  Without a CUDA device (``--device auto`` on a machine without
one, or ``--device cpu``) each part runs its cpu side only, smaller, and says what it
skipped and why: the run then exercises the script, it proves nothing about CUDA.

Exit status: 0 when every part that ran met its criterion, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

#: the issue's simulator command (speed), and the one that learns (accuracy within 0.01)
SPEED = ["--algorithm", "fedavg", "--dataset", "digits", "--partition", "iid", "--topology", "erdos_renyi",
         "--topology-option", "p=0.05", "--samples-per-node", "16", "--nodes", "1000", "--rounds", "3"]
ACCURACY = ["--algorithm", "fedavg", "--dataset", "digits", "--partition", "iid", "--topology", "erdos_renyi",
            "--topology-option", "p=0.05", "--samples-per-node", "16", "--nodes", "100", "--rounds", "10",
            "--epochs", "10", "--batch-size", "16"]
ACCURACY_TOL, ACCURACY_MIN = 0.01, 0.5
RTOL = 1e-4


def _env() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), device_memory_mb=p.total_memory // 2**20,
                    device_count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    try:
        import dfl_agent

        info["dfl_agent"] = dfl_agent.__version__
    except ImportError:  # pragma: no cover - the script installs it first
        info["dfl_agent"] = None
    return info


# -- 2. the simulator ----------------------------------------------------------------------------

def _simulate(args: list[str], device: str, out: Path) -> dict[str, Any]:
    """One ``dflctl simulate`` process; its summary's figures, or its error."""
    cmd = [sys.executable, "-m", "dfl_agent.cli.dflctl", "simulate", *args, "--device", device,
           "--no-progress", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"command": "dflctl " + " ".join(cmd[3:-2]), "device": device, "rc": proc.returncode,
                           "process_s": round(wall, 1)}
    if proc.returncode != 0:
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return row
    s = json.loads((out / "summary.json").read_text())
    nodes, rounds = s["nodes"], s["rounds_completed"]
    row.update(nodes=nodes, rounds=rounds, wall_s=round(s["wall_seconds"], 2),
               node_rounds_per_s=round(nodes * rounds / s["wall_seconds"], 1),
               global_accuracy=round(s["global_accuracy"]["mean"], 4),
               curve=[round(a, 4) for a in s["curve"]["global_accuracy"]],
               cuda_peak_memory_mb=s.get("cuda_peak_memory_mb"), batching=s.get("batching"))
    return row


def part_simulate(cuda: bool, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"speed": [], "accuracy": []}
    devices = ["cpu", "cuda"] if cuda else ["cpu"]
    for dev in devices:
        res["speed"].append(_simulate(SPEED, dev, work / f"speed-{dev}"))
        res["accuracy"].append(_simulate(ACCURACY, dev, work / f"accuracy-{dev}"))
    ok = all(r["rc"] == 0 for r in res["speed"] + res["accuracy"])
    acc = {r["device"]: r.get("global_accuracy") for r in res["accuracy"]}
    ok = ok and (acc.get("cpu") or 0) > ACCURACY_MIN
    if cuda and ok:
        sp = {r["device"]: r["node_rounds_per_s"] for r in res["speed"]}
        res["speed_ratio_cuda_over_cpu"] = round(sp["cuda"] / sp["cpu"], 2)
        res["accuracy_difference"] = round(abs(acc["cuda"] - acc["cpu"]), 4)
        ok = ok and res["accuracy_difference"] <= ACCURACY_TOL and acc["cuda"] > ACCURACY_MIN
    if not cuda:
        res["skipped"] = "the CUDA runs: no CUDA device (cpu side only)"
        # what a user sees when asking for CUDA on such a machine: exit 2, one line
        p = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "simulate", "--device", "cuda",
                            "--nodes", "2", "--rounds", "1", "--dataset", "digits", "--partition", "iid",
                            "--no-progress"], capture_output=True, text=True, timeout=120)
        res["device_cuda_without_cuda"] = {"rc": p.returncode, "stderr": p.stderr.strip()}
        ok = ok and p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    res["ok"] = ok
    return res


# -- 3. the batched step against the per-node loop ------------------------------------------------

def part_batch(device: str, groups: int) -> dict[str, Any]:
    """``groups`` nodes of the simulator's default digits model, 16 samples each, one
    round of 10 epochs (batch 16): the vectorised step against a loop of ``train_local``,
    both on ``device``; parameters compared, both timed (after a warm-up)."""
    import torch

    from dfl_agent.data import load_dataset
    from dfl_agent.learning.training import TrainConfig, round_batches, train_local
    from dfl_agent.models import build_model
    from dfl_agent.runtime.node.batching import train_group
    from dfl_agent.runtime.node.simulator import sampled_parts
    from dfl_agent.runtime.shared.assembly import algorithm_default_spec

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    pool = load_dataset("digits").pool
    spec = algorithm_default_spec("fedavg", pool.input_shape, pool.num_classes, "medium")
    parts = sampled_parts(len(pool), groups, 16, seed=0)
    data = [(pool.x[p], pool.y[p]) for p in parts]
    cfg = TrainConfig(epochs=10, batch_size=16)

    def models() -> list[Any]:
        out = []
        for i in range(groups):
            torch.manual_seed(i)
            out.append(build_model(spec).to(device))
        return out

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def run_loop(ms: list[Any]) -> float:
        sync()
        t0 = time.perf_counter()
        for i, (m, (x, y)) in enumerate(zip(ms, data)):
            train_local(m, x, y, cfg, np.random.default_rng(i), device)
        sync()
        return time.perf_counter() - t0

    def run_batched(ms: list[Any]) -> float:
        members = [(m, x, y, round_batches(len(x), cfg, np.random.default_rng(i)))
                   for i, (m, (x, y)) in enumerate(zip(ms, data))]
        sync()
        t0 = time.perf_counter()
        train_group(members, cfg)
        sync()
        return time.perf_counter() - t0

    run_loop(models()[:4])  # warm-up: kernels, autograd, cuBLAS handles
    run_batched(models()[:4])
    loop, batched = models(), None
    batched = [copy.deepcopy(m) for m in loop]
    t_loop, t_batched = run_loop(loop), run_batched(batched)
    worst = 0.0
    for a, b in zip(batched, loop):
        for p, q in zip(a.parameters(), b.parameters()):
            d = float((p.detach().double() - q.detach().double()).norm() / q.detach().double().norm().clamp_min(1e-12))
            worst = max(worst, d)
    return {"device": device, "nodes": groups, "samples_per_node": 16, "epochs": cfg.epochs,
            "batch_size": cfg.batch_size, "model": spec, "loop_s": round(t_loop, 3), "batched_s": round(t_batched, 3),
            "speed_ratio_batched_over_loop": round(t_loop / t_batched, 2), "max_relative_difference": worst,
            "ok": worst <= RTOL}


# -- 4. two agents over a local amqtt broker -------------------------------------------------------

def part_federation(cuda: bool, work: Path, rounds: int = 3) -> dict[str, Any]:
    """Two ``dfl-agent`` processes on this machine's loopback, an amqtt broker, discovery by
    MQTT presence only (``discovery.mdns = false``, no static peers): agent ``gpu`` on
    CUDA (profile generic-cuda: mixed precision on) or, without CUDA, on cpu; agent
    ``cpu`` on cpu.  Both must finish every round having aggregated the other's model."""
    from dfl_agent.cli.broker import start_broker
    from dfl_agent.cli.observer import Observer
    from dfl_agent.runtime.shared.config import (
        AlgorithmSection,
        DataSection,
        DiscoverySection,
        ModelSection,
        MqttSection,
        NodeConfig,
        RuntimeSection,
        TrainingSection,
        dump_toml,
    )

    ids = ["gpu", "cpu"]
    fed = f"gpucheck{os.getpid()}"
    plan = {"gpu": ("generic-cuda", "cuda") if cuda else ("generic-x86", "cpu"), "cpu": ("generic-x86", "cpu")}
    res: dict[str, Any] = {"rounds": rounds, "agents": {}}
    if not cuda:
        res["skipped"] = "the CUDA agent: no CUDA device (both agents on cpu)"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with start_broker("amqtt") as broker:
        res["broker"] = broker.kind
        procs, logs = {}, {}
        for i, nid in enumerate(ids):
            profile, device = plan[nid]
            node_dir = work / nid
            cfg = NodeConfig(
                federation=fed, node_id=nid, state_dir=str(node_dir), seed=0, profile=profile,
                profile_overrides={"limits": {"max_load_per_core": 0}, "training": {"windows": []}},
                algorithm=AlgorithmSection(name="fedavg", rounds=rounds, options={"round_timeout": 60.0}),
                model=ModelSection(size="small"),
                training=TrainingSection(epochs=2, threads=1, device=device),
                data=DataSection(dataset="digits", partition="iid", num_nodes=2, node_index=i),
                mqtt=MqttSection(broker=broker.endpoint, protocol="3.1.1", heartbeat_interval=0.5),
                discovery=DiscoverySection(mdns=False, min_peers=1, start_timeout=90.0, heartbeat_timeout=60.0),
                runtime=RuntimeSection(log_level="info", metrics_file=str(node_dir / "metrics.jsonl")),
            )
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "node.toml").write_text(dump_toml(cfg), encoding="utf-8")
            logs[nid] = open(work / f"{nid}.log", "w", encoding="utf-8")
            procs[nid] = subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config",
                 str(node_dir / "node.toml")], stdout=logs[nid], stderr=subprocess.STDOUT, env=env)
        observer = Observer(broker.endpoint, fed, protocol="3.1.1").start()
        devices: dict[str, Any] = {}
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
                statuses, _ = observer.snapshot()
                for nid, st in statuses.items():
                    if st.get("device"):
                        devices[nid] = st["device"]
                time.sleep(0.5)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        p.kill()
            observer.stop()
            for f in logs.values():
                f.close()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    ok = True
    for nid in ids:
        mpath = work / nid / "metrics.jsonl"
        recs = [json.loads(line) for line in mpath.read_text().splitlines() if line.strip()] if mpath.exists() else []
        other = next(o for o in ids if o != nid)
        aggregated = [r["round"] for r in recs if other in (r.get("neighbour_ids") or [])]
        row = {"profile": plan[nid][0], "device_requested": plan[nid][1], "device_reported": devices.get(nid),
               "exit_code": procs[nid].returncode, "rounds_recorded": [r["round"] for r in recs],
               "rounds_aggregated_with_peer": aggregated,
               "final_global_accuracy": round(recs[-1]["global_accuracy"], 4) if recs else None}
        want_dev = "cuda:0" if plan[nid][1] == "cuda" else "cpu"
        row["ok"] = (row["exit_code"] == 0 and aggregated == list(range(1, rounds + 1))
                     and row["device_reported"] == want_dev)
        if not row["ok"]:
            row["log_tail"] = (work / f"{nid}.log").read_text(errors="replace").splitlines()[-15:]
        ok = ok and row["ok"]
        res["agents"][nid] = row
    res["ok"] = ok
    return res


# -- the report -------------------------------------------------------------------------------------

def summary_md(r: dict[str, Any]) -> str:
    e = r["env"]
    card = e.get("device_name") or "no CUDA device"
    lines = [f"# GPU check: {card}, torch {e['torch']}", "",
             f"Python {e['python']} ({e['machine']}), torch {e['torch']} (CUDA build {e['torch_cuda']}), "
             f"dfl-agent {e.get('dfl_agent')}, {e['cpu_count']} CPU cores; "
             + (f"{card}, {e.get('device_memory_mb')} MiB." if e["cuda_available"] else
                "**no CUDA device: a CPU dry run; every CUDA part was skipped.**"), ""]
    for name in r.get("skipped_parts", []):
        lines.append(f"- skipped: {name}")
    for part in ("simulate", "batch", "federation"):
        if "error" in r.get(part, {}):
            lines.append(f"- **{part} failed**: {r[part]['error']}")
    r = {k: v for k, v in r.items() if not (isinstance(v, dict) and "error" in v)} | {"ok": r["ok"]}
    if "simulate" in r:
        s = r["simulate"]
        lines += ["", "## Simulator (dflctl simulate, fedavg on digits, erdos_renyi p=0.05, 16 samples per node)", "",
                  "| run | device | nodes x rounds | wall s | node-rounds/s | global accuracy | peak GPU MiB | rc |",
                  "|---|---|---|---|---|---|---|---|"]
        for kind in ("speed", "accuracy"):
            for row in s[kind]:
                lines.append(f"| {kind} | {row['device']} | {row.get('nodes', '-')} x {row.get('rounds', '-')} | "
                             f"{row.get('wall_s', '-')} | {row.get('node_rounds_per_s', '-')} | "
                             f"{row.get('global_accuracy', '-')} | {row.get('cuda_peak_memory_mb') or '-'} | {row['rc']} |")
        if "speed_ratio_cuda_over_cpu" in s:
            lines += ["", f"Speed ratio CUDA / cpu (node-rounds per second): **{s['speed_ratio_cuda_over_cpu']}x**; "
                      f"accuracy difference {s['accuracy_difference']} (criterion <= {ACCURACY_TOL}, both > {ACCURACY_MIN})."]
        if "device_cuda_without_cuda" in s:
            d = s["device_cuda_without_cuda"]
            lines += ["", f"`dflctl simulate --device cuda` without CUDA: exit {d['rc']}, `{d['stderr']}`"]
        if "skipped" in s:
            lines += ["", f"Skipped: {s['skipped']}."]
        lines.append(f"\nSpeed command: `dflctl simulate {' '.join(SPEED)} --device DEVICE`; accuracy command: "
                     f"`dflctl simulate {' '.join(ACCURACY)} --device DEVICE`. ok: {s['ok']}")
    if "batch" in r:
        b = r["batch"]
        lines += ["", "## Batched training step against the per-node loop", "",
                  f"{b['nodes']} nodes x {b['samples_per_node']} samples, {b['epochs']} epochs of batch "
                  f"{b['batch_size']}, on {b['device']}: per-node loop {b['loop_s']} s, batched {b['batched_s']} s, "
                  f"**{b['speed_ratio_batched_over_loop']}x**; largest relative parameter difference "
                  f"{b['max_relative_difference']:.2e} (criterion <= {RTOL:g}). ok: {b['ok']}"]
        if "skipped" in b:
            lines.append(f"\nSkipped: {b['skipped']}.")
    if "federation" in r:
        f = r["federation"]
        lines += ["", f"## Two agents over amqtt on loopback (mdns off, MQTT presence), fedavg, {f['rounds']} rounds", "",
                  "| agent | profile | device (status) | exit | rounds aggregated with the peer | final accuracy | ok |",
                  "|---|---|---|---|---|---|---|"]
        for nid, a in f["agents"].items():
            lines.append(f"| {nid} | {a['profile']} | {a['device_reported']} | {a['exit_code']} | "
                         f"{a['rounds_aggregated_with_peer']} | {a['final_global_accuracy']} | {a['ok']} |")
        if "skipped" in f:
            lines.append(f"\nSkipped: {f['skipped']}.")
    lines += ["", f"All parts that ran met their criteria: **{r['ok']}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--parts", default="simulate,batch,federation")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: cuda when torch sees a CUDA device")
    ap.add_argument("--batch-nodes", type=int, default=None, help="nodes of the batched-step part (cuda 1000, cpu 50)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in a.parts.split(",") if p]
    r: dict[str, Any] = {"env": _env(), "skipped_parts": []}
    if not cuda:
        r["skipped_parts"].append("every CUDA run: no CUDA device visible to torch "
                                  f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    work = Path(tempfile.mkdtemp(prefix="dfl-gpu-check-"))
    for part in parts:
        t0 = time.perf_counter()
        print(f"check: {part} ...", flush=True)
        try:
            if part == "simulate":
                r[part] = part_simulate(cuda, work)
            elif part == "batch":
                dev = "cuda:0" if cuda else "cpu"
                r[part] = part_batch(dev, a.batch_nodes or (1000 if cuda else 50))
                if not cuda:
                    r[part]["skipped"] = "CUDA: no CUDA device (the same comparison on cpu)"
            elif part == "federation":
                r[part] = part_federation(cuda, work / "federation")
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as exc:  # noqa: BLE001 - recorded, the other parts still run
            r[part] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        r[part]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"check: {part}: ok={r[part]['ok']} in {r[part]['seconds']} s", flush=True)
    r["ok"] = all(r[p]["ok"] for p in parts)
    (out / "results.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(summary_md(r))
    print(summary_md(r))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
