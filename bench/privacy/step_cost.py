"""CPU cost of a DP-SGD step against a plain SGD step, in the same process.

The HAR default CNN (``dfl_agent.models.default_spec`` for HAR's input shape, size tier
medium), batch size 32, one torch thread.  Both go through the training entry point the
algorithms use, :func:`dfl_agent.learning.training.train_local`, for ``--steps`` mini-batch
steps per call: plain (``TrainConfig(steps=K)``) and DP (``TrainConfig(steps=K, dp=...)``:
Poisson batches of rate 32/N, per-sample clipping and noise through Opacus).  Calls
alternate plain, DP, plain, DP, ... ``--repeats`` times each, so both see the same load;
the CPU seconds of each call come from ``time.process_time`` (this process's user + system
time, not the wall clock).  The result is the median CPU seconds per step of each and their
ratio.

Usage (from the repository root)::

    nice -n 19 .venv/bin/python bench/privacy/step_cost.py --out bench/privacy/results/step_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="mini-batch steps per training call")
    ap.add_argument("--repeats", type=int, default=7, help="training calls of each kind")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--samples", type=int, default=640, help="training samples (HAR windows)")
    ap.add_argument("--out", type=Path, default=None, help="write the result here (JSON)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    from dfl_agent.data.har import load_har
    from dfl_agent.learning.dp import DPTraining
    from dfl_agent.learning.training import TrainConfig, train_local
    from dfl_agent.models import build_model, default_spec

    bundle = load_har()
    pool = bundle.pool
    x, y = pool.x[: a.samples], pool.y[: a.samples]
    spec = default_spec(list(pool.input_shape), int(pool.num_classes), "medium")
    model = build_model(spec)
    q = a.batch_size / len(y)
    plain = TrainConfig(batch_size=a.batch_size, steps=a.steps, lr=0.05)
    private = TrainConfig(batch_size=a.batch_size, steps=a.steps, lr=0.05,
                          dp=DPTraining(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=q))
    rng = np.random.default_rng(0)
    train_local(model, x, y, plain, rng, "cpu")  # warm-up: first-call costs out of the figures
    train_local(model, x, y, private, rng, "cpu")
    times: dict[str, list[float]] = {"plain": [], "dp": []}
    for _ in range(a.repeats):
        for name, cfg in (("plain", plain), ("dp", private)):
            t0 = time.process_time()
            train_local(model, x, y, cfg, rng, "cpu")
            times[name].append((time.process_time() - t0) / a.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "model": spec, "batch_size": a.batch_size, "steps_per_call": a.steps, "repeats": a.repeats,
        "threads": torch.get_num_threads(), "samples": int(len(y)), "sample_rate": q,
        "cpu_seconds_per_step": {k: round(v, 6) for k, v in med.items()},
        "all_cpu_seconds_per_step": {k: [round(t, 6) for t in v] for k, v in times.items()},
        "ratio": round(med["dp"] / med["plain"], 3),
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
        "command": "nice -n 19 .venv/bin/python bench/privacy/step_cost.py " + " ".join(argv or sys.argv[1:]),
    }
    print(json.dumps({k: res[k] for k in ("cpu_seconds_per_step", "ratio")}))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
