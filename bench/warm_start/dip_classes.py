"""Which validation windows a warm-started run's first round gets wrong that the deployed model got right.

The setup of ``ramp.py``: four HAR users, one device each, a ``cnn1d`` (medium), FedAvg with
exact averaging.  Each seed trains a first run of 60 rounds on the first 96 windows of each
user's recording, then one round (at ``--scale`` of the rate, the ramp's first round) on 320
windows, which hold two activities the first 96 did not.  Reported: the activities present in
each part, and, summed over seeds and devices, the validation windows (the deploy gate's
slice, ``validation_mask`` share 0.2) that the starting model classified correctly and round 1
did not, by true activity and by the activity round 1 predicted; and those it gained.

    python bench/warm_start/dip_classes.py --seeds 6 > bench/warm_start/results/dip_classes.md
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.*


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--scale", type=float, default=0.1, help="round 1's fraction of the rate (the ramp's first)")
    args = ap.parse_args(argv)
    import torch

    from bench.warm_start.har_fedavg import fedavg_round, har_devices
    from dfl_agent.learning.training import ramped
    from dfl_agent.models import build_model

    har = har_devices()
    pool, data, spec, base = har.pool, har.data, har.spec, har.base
    names = list(getattr(pool, "class_names", range(pool.num_classes)))

    def predict(model, i):
        x, y, val = data[i]
        with torch.no_grad():
            return model(torch.from_numpy(x[val])).argmax(1).numpy(), y[val]

    lost = np.zeros((pool.num_classes, pool.num_classes), int)
    gained = np.zeros(pool.num_classes, int)
    total = 0
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        models = [build_model(spec)]
        models += [copy.deepcopy(models[0]) for _ in range(3)]
        for _ in range(60):
            fedavg_round(models, data, 96, base, rng)
        after = copy.deepcopy(models)
        fedavg_round(after, data, 320, ramped(base, args.scale), np.random.default_rng(seed + 100))
        for i in range(4):
            p0, y = predict(models[i], i)
            p1, _ = predict(after[i], i)
            total += len(y)
            for t, q in zip(y[(p0 == y) & (p1 != y)], p1[(p0 == y) & (p1 != y)]):
                lost[t, q] += 1
            for t in y[(p0 != y) & (p1 == y)]:
                gained[t] += 1
        print(f"seed {seed} done", file=sys.stderr, flush=True)
    first = sorted({int(c) for x, y, _ in data for c in y[:96]})
    print(f"`python bench/warm_start/dip_classes.py --seeds {args.seeds} --scale {args.scale}` "
          f"({args.seeds} seeds x 4 devices, {total} validation windows in all)\n")
    print(f"Activities in the first 96 windows: {', '.join(str(names[c]) for c in first)}; the 320 add "
          f"{', '.join(str(names[c]) for c in range(pool.num_classes) if c not in first)}.\n")
    print(f"Right before round 1, wrong after it: {int(lost.sum())}; wrong before, right after: {int(gained.sum())}.\n")
    print("| true activity | lost | predicted after round 1 as |")
    print("|---|---|---|")
    for t in range(pool.num_classes):
        if lost[t].sum():
            as_ = ", ".join(f"{names[q]} {lost[t, q]}" for q in np.argsort(-lost[t]) if lost[t, q])
            print(f"| {names[t]} | {int(lost[t].sum())} | {as_} |")
    print("\n| true activity | gained |")
    print("|---|---|")
    for t in range(pool.num_classes):
        if gained[t]:
            print(f"| {names[t]} | {int(gained[t])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
