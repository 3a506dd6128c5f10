"""How often local training's blow-up check (``training.divergence_factor``) fires, and what
it stops, in the simulator.

Two experiments, each with the check at its default (10) and off (0):

- ``healthy``: fedavg on HAR by user, six nodes under ``quorum`` with speeds 1,1,1,1,1,0.2,
  four epochs a round at ``training.lr`` 0.05 (the field lab's blow-up settings), default
  compression.  Counts the trainings the check undid (``exploded``) and the final accuracy:
  a check that fires on sound training shows as undone rounds with no accuracy gained.
- ``wild``: four fedavg nodes on digits under ``quorum``, one of whose local training runs at
  ``training.lr`` 5 in round 4 (its loss goes from about 2 to 10^1-10^2, finite, as in the
  field lab's blow-ups).  With the check off the plain mean passes the broken model on.

Usage: python bench/blow_up/sim.py [--seeds N] [--rounds R] > bench/blow_up/results/sim.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from dfl_agent.learning.training import TrainConfig, train_local
from dfl_agent.runtime.node.simulator import SimConfig, round_records


def wild_in_round(algorithm, wild: int, lr: float = 5.0) -> None:
    """Make ``algorithm``'s (a simulated node's) local training of round ``wild`` run at
    learning rate ``lr``; its other rounds train as configured."""
    real, calls = algorithm._train, [0]

    async def wild_train() -> dict:
        calls[0] += 1
        if calls[0] != wild:
            return await real()
        ctx = algorithm.ctx
        return await ctx.compute(train_local, algorithm.model, ctx.data.train_x, ctx.data.train_y,
                                 dataclasses.replace(ctx.train, lr=lr), ctx.rng, ctx.device)

    algorithm._train = wild_train


def healthy(seed: int, factor: float, rounds: int) -> dict:
    cfg = SimConfig(algorithm="fedavg", nodes=6, rounds=rounds, dataset="har", partition="by-user", seed=seed,
                    straggler="quorum", speeds=[1, 1, 1, 1, 1, 0.2],
                    train=TrainConfig(epochs=4, lr=0.05, divergence_factor=factor))
    by = round_records(cfg)
    return {"diverged": sum(r.get("diverged", 0) for recs in by.values() for r in recs[-1:]),
            "final": statistics.mean(recs[-1]["global_accuracy"] for recs in by.values()),
            "worst_loss": max(r.get("train_loss") or 0.0 for recs in by.values() for r in recs)}


def wild(seed: int, factor: float, rounds: int) -> dict:
    cfg = SimConfig(algorithm="fedavg", nodes=4, rounds=rounds, dataset="digits", partition="iid", seed=seed,
                    model_size="small", straggler="quorum", train=TrainConfig(epochs=1, lr=0.05,
                                                                             divergence_factor=factor))
    by = round_records(cfg, lambda fed: wild_in_round(fed.nodes[0].algorithm, 4))
    others = [n for n in by if n != "node00"]
    return {"others_final_min": min(by[n][-1]["global_accuracy"] for n in others),
            "node00_final": by["node00"][-1]["global_accuracy"],
            "rejoined": [r["round"] for r in by["node00"] if r.get("cold_start") == "diverged"],
            "others_diverged": sum(by[n][-1].get("diverged", 0) for n in others)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| experiment | seed | divergence_factor | result |\n|---|---|---|---|")
    for seed in range(a.seeds):
        for factor in (10.0, 0.0):
            for name, fn, rounds in (("healthy", healthy, a.rounds), ("wild", wild, 16)):
                out = fn(seed, factor, rounds)
                rows.append({"experiment": name, "seed": seed, "divergence_factor": factor, **out})
                print(f"| {name} | {seed} | {factor:g} | {json.dumps(out)} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
