"""Small ablation behind the README's analysis of DecHW's late plateau at Dir(0.2):
DecHW with its ALGORITHMS.md defaults vs the accumulation / normalisation options and
the θ cut-off, on one (dataset, α, seed) of the main benchmark.

Usage (from the repository root, ~2 min)::

    nice -n 10 .venv/bin/python bench/dechw/ablation.py [--dataset digits --alpha 0.2 --seed 0]

Writes ``bench/dechw/results/ablation_{dataset}_a{alpha}_s{seed}.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402

VARIANTS = {
    "DecHW (defaults: batch_sq_grad, l2, sum, β=1)": {},
    "DecHW† θ=30": {"theta": 30},
    "accumulate=ema, β=0.5": {"accumulate": "ema", "beta": 0.5},
    "accumulate=ema, β=1 (no accumulation, App. D)": {"accumulate": "ema", "beta": 1.0},
    "norm=per_layer_l2": {"norm": "per_layer_l2"},
    "estimator=per_sample_sq_grad": {"estimator": "per_sample_sq_grad"},
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="digits", choices=sorted(bench.DATASETS))
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/dechw_ablation")
    a = p.parse_args()
    ns = argparse.Namespace(nodes=20, rounds=60, p=0.2, theta=30, har_pool=3000, har_test=1000)
    work = Path(a.work)
    rows = {}
    for label, opts in VARIANTS.items():
        cfg = bench.sim_config("dechw", a.dataset, a.alpha, a.seed, ns, work)
        cfg.options = dict(opts)
        cfg.out = str(work / label.split()[0].replace("=", "_") / str(len(rows)))
        t0 = time.time()
        bench.simulate(cfg)
        run = bench.summarise_run(Path(cfg.out), ns.rounds)
        rows[label] = {"final": run["final_mean"], "last10": float(np.mean(run["accuracy"][-10:])),
                       "std_nodes": run["final_std_nodes"], "round30": run["accuracy"][29],
                       "wall_seconds": round(time.time() - t0, 1)}
        print(label, rows[label], flush=True)
    out = Path(__file__).resolve().parent / "results"
    stem = f"ablation_{a.dataset}_a{a.alpha}_s{a.seed}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [f"# DecHW ablation: {a.dataset}, Dir({a.alpha}), seed {a.seed}, 20 nodes, Erdős–Rényi p=0.2, 60 rounds\n",
             "| variant | acc. round 30 % | final acc. % | last-10 mean % | std over nodes (points) |",
             "|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {100 * r['round30']:.2f} | {100 * r['final']:.2f} | {100 * r['last10']:.2f} | "
                     f"{100 * r['std_nodes']:.1f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
