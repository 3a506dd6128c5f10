"""q8 against float32 in bytes and accuracy with zstd-compressed envelope headers.

Re-measures the q8 rows of the main grid (``run.py``: 6 nodes, digits Dirichlet β 0.5 for
20 rounds, HAR by user for 10 rounds, seed 0, 1 local epoch) after envelope headers
became zstd-compressed (``dfl_agent.transport.wire``); DFML on HAR at lr 0.01, the lr
``bench/dfml`` chose (see README "Why q8 lost on HAR/dfml"), the others at the grid's 0.05.

Usage: nice -n 10 .venv/bin/python bench/compression/q8_bytes.py   (about 5 min; writes results/q8_bytes.md)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    import torch

    from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE.parent.parent))
    from bench.compression.run import DATASETS

    lines = ["# q8 vs float32 with compressed envelope headers (seed 0, the main grid's scale)", "",
             "Command: `nice -n 10 .venv/bin/python bench/compression/q8_bytes.py`.", "",
             "| data | algorithm | lr | float32 accuracy | q8 accuracy | Δ (pt) | float32 MB | q8 MB | × fewer bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ds, base in DATASETS.items():
        for alg in ("fedavg", "dechw", "dfml"):
            lr = 0.01 if (ds, alg) == ("har", "dfml") else 0.05
            got = {}
            for spec in ("none", "q8"):
                t0 = time.time()
                s = simulate(SimConfig(threads=1, eval_every=base["rounds"], algorithm=alg, compression=spec, seed=0,
                                       train=TrainConfig(lr=lr), **base))
                got[spec] = (s["global_accuracy"]["mean"], s["bytes_sent"])
                print(ds, alg, spec, got[spec], f"{time.time() - t0:.0f}s", flush=True)
            (a0, b0), (a1, b1) = got["none"], got["q8"]
            lines.append(f"| {ds} | {alg} | {lr} | {100 * a0:.2f} | {100 * a1:.2f} | {100 * (a1 - a0):+.2f} | "
                         f"{b0 / 1e6:.3f} | {b1 / 1e6:.3f} | {b0 / b1:.3f} |")
    (HERE / "results" / "q8_bytes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    main()
