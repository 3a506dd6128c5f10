"""HAR / dfml at the compression grid's scale (6 nodes, by user, 10 rounds) for a given
learning rate and list of ``spec,seed`` pairs: the runs behind "Why q8 lost on HAR/dfml"
in README.md here.  Prints one line per run: accuracy, bytes, ``dfml.update`` bytes
(fewer than the others of the same spec = rounds whose mutual-learning step diverged
and was skipped) and wall seconds.

Usage (from the repository root):
    nice -n 10 .venv/bin/python bench/compression/dfml_har.py 0.05 q8/256,0 q8/256,1 q8/256,2 fp16,1 fp16,2
    nice -n 10 .venv/bin/python bench/compression/dfml_har.py 0.01 none,0 q8,0 none,1 q8,1 none,2 q8,2
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main(argv: list[str]) -> None:
    import torch

    from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig

    torch.set_num_threads(1)
    lr = float(argv[0])
    for spec, seed in (a.split(",") for a in argv[1:]):
        t0 = time.time()
        s = simulate(SimConfig(threads=1, eval_every=2, dataset="har", nodes=6, rounds=10, partition="by-user",
                               algorithm="dfml", compression=spec, error_feedback=True, seed=int(seed),
                               train=dataclasses.replace(TrainConfig(), lr=lr)))
        print(f"| {lr} | `{spec}` | {seed} | {s['global_accuracy']['mean']:.4f} | {s['bytes_sent']} | "
              f"{s['bytes_sent_by_kind'].get('dfml.update', 0)} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
