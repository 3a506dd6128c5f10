"""What the blow-up check (``training.divergence_factor``) costs a round of local training:
CPU seconds of :func:`dfl_agent.learning.training.train_local` with the check (10) and
without it (0), on the HAR default model and 240 windows (a lab device's store), at four
epochs a round (the lab's stragglers scenarios), one epoch (the default) and one SGD step a
round (CHOCO-SGD's setting).  The two are timed alternately, ``--repeats`` times each, in one
process with one torch thread; the ratio of the medians is the check's cost.

Usage: python bench/blow_up/cost.py [--repeats N] > bench/blow_up/results/cost.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dfl_agent.data import load_dataset
from dfl_agent.learning.training import TrainConfig, train_local
from dfl_agent.models import build_model, default_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pool = load_dataset("har").pool
    x, y = pool.x[:240], pool.y[:240]
    spec = default_spec(x.shape[1:], int(pool.y.max()) + 1)
    print(f"`python bench/blow_up/cost.py --repeats {a.repeats}` (HAR default model, 240 windows, batch 32, "
          "one torch thread; CPU seconds per round, median)\n")
    print("| round | without the check (s) | with it (s) | with / without |\n|---|---|---|---|")
    for name, kw in (("4 epochs", {"epochs": 4}), ("1 epoch", {"epochs": 1}), ("1 SGD step", {"steps": 1})):
        times: dict[float, list[float]] = {0.0: [], 10.0: []}
        for r in range(a.repeats + 1):
            for factor in (0.0, 10.0):
                torch.manual_seed(r)
                model = build_model(spec)
                cfg = TrainConfig(divergence_factor=factor, **kw)
                start = time.process_time()
                out = train_local(model, x, y, cfg, np.random.default_rng(r))
                if r:  # the first repeat warms up
                    times[factor].append(time.process_time() - start)
                assert out["diverged"] == 0.0
        off, on = statistics.median(times[0.0]), statistics.median(times[10.0])
        print(f"| {name} | {off:.4f} | {on:.4f} | {on / off:.3f} |", flush=True)


if __name__ == "__main__":
    main()
