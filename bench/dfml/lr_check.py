"""Learning-rate check that led to the per-method selection (digits, Dirichlet 0.1, 20 nodes,
63 rounds, seed 0): DFML and dfedavg at lr 0.01 vs the grid's lr 0.05.

Usage: nice -n 10 .venv/bin/python bench/dfml/lr_check.py   (about 6 min on 2 cores)
Prints one line per run; the committed results are in results/lr_check.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dfl_agent.cli.progress import simulate_with_progress as simulate  # noqa: E402  (progress on stderr)
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.runtime.node.simulator import SimConfig  # noqa: E402

RUNS = [
    ("dfml", "H0", 0.01, {}),
    ("dfml", "H0", 0.05, {"mutual_epochs": 2}),
    ("dfedavg", "H0", 0.01, {}),
    ("dfml", "H2", 0.01, {}),
    ("dfml", "H2", 0.01, {"alpha_mode": "fixed"}),
    ("dfedavg", "H2", 0.01, {}),
]
for alg, fam, lr, opts in RUNS:
    s = simulate(SimConfig(algorithm=alg, nodes=20, rounds=63, dataset="digits", partition="dirichlet", beta=0.1,
                           model_family=fam, seed=0, options=opts, train=TrainConfig(batch_size=64, lr=lr)))
    reg = s.get("regular_global_accuracy", {}).get("mean")
    print(f"{alg} {fam} lr={lr} {opts}: global {s['global_accuracy']['mean']:.3f}"
          + (f" (regular {reg:.3f})" if reg is not None else "")
          + f", validation (local) {s['local_accuracy']['mean']:.3f}", flush=True)
