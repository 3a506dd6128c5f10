"""DFML benchmark: the shape of seed 000's Tables 3/6 (DFML vs cluster-wise FedAvg),
Table 8 (rounds to reach FedAvg's final accuracy) and Table 9 (CE/WSM x fixed/cyclic α),
at a scale that fits a 2-core CPU.

Usage (from the repository root):
    nice -n 10 .venv/bin/python bench/dfml/run.py            # the whole grid, then the report
    .venv/bin/python bench/dfml/run.py --report              # only rebuild report.md and plots

Each run is saved as results/runs/<name>.json as soon as it finishes (a rerun skips
runs already there), so an interrupted benchmark keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs"
SEEDS = (0, 1, 2)
DIGITS = dict(dataset="digits", nodes=20, rounds=63)  # 63 = end of the third α cycle
HAR = dict(dataset="har", nodes=10, rounds=32, partition="by-user")  # 32 = end of the second cycle
PARTS = {"iid": dict(partition="iid"), "noniid": dict(partition="dirichlet", beta=0.1)}


def grid() -> list[tuple[str, dict]]:
    g = []
    for part, pk in PARTS.items():
        for fam in ("H2", "H0"):
            algs = ["dfml", "dfedavg", "local"] + (["dfedprox"] if fam == "H0" else [])
            for alg in algs:
                for seed in SEEDS:
                    g.append((f"digits-{part}-{fam}-{alg}-s{seed}",
                              dict(DIGITS, **pk, model_family=fam, algorithm=alg, seed=seed)))
    for seed in SEEDS:  # peak-rule option of the seed's appendix, and the ablation (Table 9)
        base = dict(DIGITS, **PARTS["noniid"], model_family="H2", algorithm="dfml", seed=seed)
        g.append((f"digits-noniid-H2-dfml_top2-s{seed}", dict(base, options={"peak_top_k": 2})))
        for sup in ("ce", "wsm"):
            for mode in ("fixed", "cyclic"):
                if (sup, mode) != ("wsm", "cyclic"):
                    g.append((f"digits-noniid-H2-abl_{sup}_{mode}-s{seed}",
                              dict(base, options={"supervision": sup, "alpha_mode": mode})))
    for alg in ("dfml", "dfedavg", "local"):
        g.append((f"har-byuser-H2-{alg}-s0", dict(HAR, model_family="H2", algorithm=alg, seed=0)))
    for alg in ("dfml", "dfedavg", "heterofl", "fedrolex"):  # H1: width-scaled CNNs
        for seed in SEEDS:
            g.append((f"digits-noniid-H1-{alg}-s{seed}",
                      dict(DIGITS, **PARTS["noniid"], model_family="H1", algorithm=alg, seed=seed)))
    return g


def run_all() -> None:
    from agent.learning.training import TrainConfig
    from agent.runtime.simulator import SimConfig, simulate

    RUNS.mkdir(parents=True, exist_ok=True)
    for name, kw in grid():
        path = RUNS / f"{name}.json"
        if path.exists():
            continue
        t0 = time.time()
        cfg = SimConfig(train=TrainConfig(batch_size=64, lr=0.05), eval_every=1, **kw)
        summary = simulate(cfg)
        summary.pop("config", None)
        path.write_text(json.dumps({"name": name, "config": kw, "summary": summary}, default=str))
        print(f"{name}: {summary['global_accuracy']['mean']:.3f} in {time.time() - t0:.0f}s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--report", action="store_true", help="only rebuild the report from saved runs")
    a = p.parse_args()
    if not a.report:
        run_all()
    from bench.dfml.report import write_report

    write_report(RUNS, HERE / "results")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main())
