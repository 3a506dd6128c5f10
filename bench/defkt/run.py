"""Def-KT benchmark: Def-KT vs FullAvg vs Combo in the paper's setting at a smaller scale.

Runs the simulator (:func:`dfl_agent.runtime.node.simulator.simulate`, virtual time, one torch
thread) one configuration at a time and appends one JSON line per run to
``<out>/runs.jsonl`` (resumable: runs already there are skipped).  Then
``bench/defkt/report.py`` turns that file into tables and plots.

Parts (``--parts``, default all):

- ``A``: K = 10 nodes, Q = 1; HAR (IID, ζ-class shards ζ = 3, 2) and digits (IID,
  ζ = 4, 2); defkt, fullavg, combo; seeds 0, 1, 2.
- ``B``: K = 50 nodes, Q = 5; digits ζ = 2; the three algorithms; seeds 0, 1, 2.
- ``C``: gossip mode vs rounds mode at equal bytes: digits ζ = 2, K = 10: defkt and
  fullavg in gossip mode for ``rounds_A / K`` steps (each step every node pushes
  about one model, so as many models as rounds mode sends in ``rounds_A`` rounds).
- ``D``: FullAvg with ``scope = all`` (every node broadcasts every round, not the
  paper's baseline) at equal bytes: digits ζ = 2, ``rounds_A / K`` rounds.
- ``E``: control for local compute: FullAvg and Combo with M = 2 (the model that
  travels gets 2 epochs per round, as in Def-KT: M = 1 at the sender + E = 1 at the
  receiver), digits ζ = 2 and HAR ζ = 2, K = 10, Q = 1.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python bench/defkt/run.py --out bench/defkt/results
    .venv/bin/python bench/defkt/report.py --out bench/defkt/results
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.metrics import read_jsonl
from dfl_agent.runtime.node.simulator import SimConfig

SEEDS = (0, 1, 2)
ALGORITHMS = ("defkt", "fullavg", "combo")

# Per-dataset settings (identical for every algorithm).  Scaled to a 2-core CPU:
# see bench/defkt/README.md.  SGD momentum 0.5 as in the paper (§IV-D).
DATASETS = {
    "har": {"rounds": 300, "eval_every": 30, "model_size": "small",
            "train": TrainConfig(batch_size=32, lr=0.02, momentum=0.5)},
    "digits": {"rounds": 1500, "eval_every": 100, "model_size": "medium",
               "train": TrainConfig(batch_size=32, lr=0.05, momentum=0.5)},
}
PARTITIONS = {"har": [("iid", 0), ("shards", 3), ("shards", 2)],
              "digits": [("iid", 0), ("shards", 4), ("shards", 2)]}


@dataclasses.dataclass(frozen=True)
class Run:
    part: str
    dataset: str
    partition: str
    zeta: int
    algorithm: str
    seed: int
    nodes: int
    rounds: int
    eval_every: int
    options: tuple = ()
    batch_size: int | None = None

    @property
    def key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return (f"{self.part}|{self.dataset}|{self.partition}{self.zeta or ''}|{self.algorithm}|{opts}|"
                f"K{self.nodes}|R{self.rounds}|s{self.seed}")


def plan(parts: str) -> Iterator[Run]:
    if "A" in parts:
        for ds in ("digits", "har"):
            s = DATASETS[ds]
            for partition, zeta in PARTITIONS[ds]:
                for seed in SEEDS:
                    for alg in ALGORITHMS:
                        yield Run("A", ds, partition, zeta, alg, seed, 10, s["rounds"], s["eval_every"], (("Q", 1),))
    if "B" in parts:
        for seed in SEEDS:
            for alg in ALGORITHMS:
                yield Run("B", "digits", "shards", 2, alg, seed, 50, 600, 60, (("Q", 5),), batch_size=8)
    steps = DATASETS["digits"]["rounds"] // 10
    if "C" in parts:
        for seed in SEEDS:
            for alg in ("defkt", "fullavg"):
                yield Run("C", "digits", "shards", 2, alg, seed, 10, steps, steps // 10, (("mode", "gossip"),))
    if "D" in parts:
        for seed in SEEDS:
            yield Run("D", "digits", "shards", 2, "fullavg", seed, 10, steps, steps // 10, (("scope", "all"),))
    if "E" in parts:
        for ds in ("digits", "har"):
            s = DATASETS[ds]
            for seed in SEEDS:
                for alg in ("fullavg", "combo"):
                    yield Run("E", ds, "shards", 2, alg, seed, 10, s["rounds"], s["eval_every"], (("M", 2), ("Q", 1)))


def curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per evaluated round: mean/std over nodes of global and local accuracy, and the
    cumulative bytes sent by all nodes up to that round (bytes_sent is per node, cumulative)."""
    by_round: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        by_round[r["round"]].append(r)
    out = []
    for t in sorted(by_round):
        recs = by_round[t]
        ev = [r for r in recs if "global_accuracy" in r]
        if not ev:
            continue
        g = torch.tensor([r["global_accuracy"] for r in ev], dtype=torch.float64)
        lo = torch.tensor([r["local_accuracy"] for r in ev], dtype=torch.float64)
        out.append({
            "round": t, "global_mean": float(g.mean()), "global_std": float(g.std(unbiased=False)),
            "local_mean": float(lo.mean()), "local_std": float(lo.std(unbiased=False)),
            "bytes_cum": int(sum(r["bytes_sent"] for r in recs)),
            "bytes_received_cum": int(sum(r["bytes_received"] for r in recs)), "nodes": len(ev),
            "time": max(r["time"] for r in recs),
        })
    return out


def execute(run: Run) -> dict[str, Any]:
    s = DATASETS[run.dataset]
    train = s["train"] if run.batch_size is None else dataclasses.replace(s["train"], batch_size=run.batch_size)
    options = dict(run.options)
    if run.algorithm == "defkt":
        # the committed results were measured with the transfer on the training optimiser
        # (before the option existed; the default is now plain steps, see transfer_step.py)
        options.setdefault("transfer_momentum", train.momentum)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SimConfig(
            algorithm=run.algorithm, nodes=run.nodes, rounds=run.rounds, dataset=run.dataset,
            partition=run.partition, zeta=max(run.zeta, 1), seed=run.seed, out=tmp, options=options,
            train=train, model_size=s["model_size"], eval_every=run.eval_every, threads=1,
        )
        started = time.time()
        summary = simulate(cfg)
        wall = time.time() - started
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
    roles = collections.Counter(r.get("role", "") for r in records)
    fused = sum(int(r.get("fused", 0)) for r in records)
    return {
        **dataclasses.asdict(run), "key": run.key, "wall_seconds": wall, "curve": curve(records),
        "bytes_sent": summary["bytes_sent"], "roles": dict(roles), "fused": fused,
        "train": dataclasses.asdict(train), "model_size": s["model_size"],
        "dropped": sum(sum(d.values()) for d in summary["dropped"].values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/defkt/results")
    p.add_argument("--parts", default="ABCDE")
    p.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    done = {r["key"] for r in read_jsonl(path)} if path.exists() else set()
    runs = list(plan(a.parts))
    if a.dry_run:
        for r in runs:
            print(r.key, "(done)" if r.key in done else "")
        return
    t0 = time.time()
    for i, run in enumerate(runs, 1):
        if run.key in done:
            continue
        res = execute(run)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(res, sort_keys=True) + "\n")
        last = res["curve"][-1]
        print(f"[{i}/{len(runs)} {time.time() - t0:6.0f}s] {run.key}: global {last['global_mean']:.3f} "
              f"local {last['local_mean']:.3f} bytes {last['bytes_cum'] / 1e6:.1f} MB ({res['wall_seconds']:.0f}s)",
              flush=True)


if __name__ == "__main__":
    main()
