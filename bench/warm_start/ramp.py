"""The first round of a warm-started run, with and without the learning-rate ramp.

Four HAR users, one device each, a ``cnn1d`` (medium), plain FedAvg with exact averaging
(no network: the learning only).  Each seed trains a first run of 60 rounds on the first
96 windows of each user's recording (only some of the activities), then starts a second run
from its model on 320 windows (new activities: *shift*), and, after 40 more rounds on them,
a third on the same 320 windows (*same*).  Each start is run for 10 rounds with each
schedule: ``none`` (the full rate from round 1) and ``ramp R`` (round t at
``0.1 + 0.9 (t-1)/R`` of the rate, ``training.warm_start_ramp = R``), each without and
with ``--probe`` (``training.warm_start_probe``: before round 1 each device fits its model's
output layer to its store when the store holds a class its model predicts for none of its
windows, :func:`dfl_agent.learning.probe.linear_probe`; the agent skips the fit when the
ramp is off, after the ``none``/``on`` row).

Reported per schedule and start: round 1's accuracy minus the starting model's, on each
device's validation slice (the deploy gate's: ``validation_mask`` share 0.2), mean and worst
over devices and seeds, the share of devices within 2 points, and the accuracy after 10
rounds.  ``--first-scales`` adds rows for round 1 alone at a fixed fraction of the rate
(does any step size avoid the first-round dip?).

    python bench/warm_start/ramp.py --seeds 6 --first-scales 0.3,0.1,0.03 --probe \\
        --json bench/warm_start/results/ramp.json > bench/warm_start/results/ramp.md
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.*


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--ramps", default="0,5,10", help="ramp lengths in rounds (0: none)")
    ap.add_argument("--first-scales", default="", help="fractions of the rate for round 1 alone, e.g. 0.1,0.03")
    ap.add_argument("--probe", action="store_true", help="add the rows with the linear probe")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from bench.warm_start.har_fedavg import fedavg_round, har_devices
    from dfl_agent.learning.probe import linear_probe
    from dfl_agent.learning.training import ramped
    from dfl_agent.models import build_model
    from dfl_agent.runtime.run.warm_start import ramp_factor

    har = har_devices()
    data, spec, base = har.data, har.spec, har.base

    def acc(model, i, n):
        x, y, val = data[i]
        with torch.no_grad():
            return float((model(torch.from_numpy(x[:n][val[:n]])).argmax(1).numpy() == y[:n][val[:n]]).mean())

    def probed(models):
        for i, m in enumerate(models):
            x, y, val = data[i]
            state = linear_probe(m, x[~val], y[~val]).state  # the store's training part: 320 windows
            m.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        return models

    ramps = [(int(r), p) for p in ((False, True) if args.probe else (False,)) for r in args.ramps.split(",")]
    firsts = [float(f) for f in args.first_scales.split(",") if f]
    out = {r: {k: [] for k in ("shift1", "same1", "shift10", "same10")} for r in ramps}
    first = {f: {"shift1": [], "same1": []} for f in firsts}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        models = [build_model(spec)]
        models += [copy.deepcopy(models[0]) for _ in range(3)]
        for _ in range(60):
            fedavg_round(models, data, 96, base, rng)
        for phase, then in (("shift", 40), ("same", 0)):
            start = [acc(m, i, 320) for i, m in enumerate(models)]
            for r, probe in ramps:
                ms, g = copy.deepcopy(models), np.random.default_rng(seed + 100)
                ms = probed(ms) if probe else ms
                for t in range(1, 11):
                    fedavg_round(ms, data, 320, ramped(base, ramp_factor({"started_from": 1}, r, t)), g)
                    if t == 1:
                        out[(r, probe)][phase + "1"] += [acc(m, i, 320) - start[i] for i, m in enumerate(ms)]
                out[(r, probe)][phase + "10"] += [acc(m, i, 320) for i, m in enumerate(ms)]
            for f in firsts:
                ms = copy.deepcopy(models)
                fedavg_round(ms, data, 320, ramped(base, f), np.random.default_rng(seed + 100))
                first[f][phase + "1"] += [acc(m, i, 320) - start[i] for i, m in enumerate(ms)]
            for _ in range(then):
                fedavg_round(models, data, 320, base, rng)
        print(f"seed {seed} done", file=sys.stderr, flush=True)
    rows = []
    for (r, probe), res in [*((r, out[r]) for r in ramps),
                            *(((f"round 1 alone at {f} x lr", False), first[f]) for f in firsts)]:
        for phase in ("shift", "same"):
            d = np.array(res[phase + "1"]) * 100
            rows.append({"ramp": r, "probe": probe, "start": phase, "n": len(d), "round1_delta_mean": round(float(d.mean()), 1),
                         "round1_delta_worst": round(float(d.min()), 1),
                         "within_2_points": round(float((d >= -2).mean()), 2),
                         "round10_accuracy": round(float(np.mean(res[phase + "10"])), 3) if phase + "10" in res
                         else None})
    print(f"`python bench/warm_start/ramp.py --seeds {args.seeds} --ramps {args.ramps} --first-scales "
          f"{args.first_scales}{' --probe' if args.probe else ''}` ({args.seeds} seeds x 4 devices per row)\n")
    print("| training.warm_start_ramp | training.warm_start_probe | start | round 1 minus start, mean (points) | "
          "worst | devices within 2 points | accuracy after 10 rounds |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        after = "-" if row["round10_accuracy"] is None else f"{row['round10_accuracy']:.3f}"
        print(f"| {row['ramp'] or 'none'} | {'on' if row['probe'] else 'off'} | {row['start']} | "
              f"{row['round1_delta_mean']:+.1f} | "
              f"{row['round1_delta_worst']:+.1f} | {row['within_2_points']:.2f} | {after} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
