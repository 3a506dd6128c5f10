"""How a device's lifetime ε grows with its runs: the accountant's composition, worked out.

A device with N = 300 training samples, batch size 32 (Poisson rate q = 32/300), one epoch per
round and 20 rounds per run: 200 DP steps per run (``steps_per_round``: ⌈300/32⌉ = 10).  For
a per-run target ε of 1, 3 and 8 (δ = 1e-5), the noise multiplier the plan picks
(:func:`dfl_agent.privacy.accountant.noise_for_epsilon`), then the device's composed ε after
k such runs (:func:`~dfl_agent.privacy.accountant.rdp_epsilon` over k copies of the run, the
RDP accountant the privacy ledger uses), and how many runs fit in a lifetime budget of
3, 10 and 30.  No training: pure arithmetic, torch-free, seconds.

Usage (from the repository root)::

    .venv/bin/python bench/privacy/composition.py --out bench/privacy/results/composition.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dfl_agent.privacy.accountant import noise_for_epsilon, rdp_epsilon
from dfl_agent.privacy.plan import steps_per_round

N, BATCH, EPOCHS, ROUNDS, DELTA = 300, 32, 1, 20, 1e-5
TARGETS = (1.0, 3.0, 8.0)
RUNS = (1, 2, 5, 10, 30, 100)
LIFETIMES = (3.0, 10.0, 30.0)


def runs_within(budget: float, run: tuple[float, float, int], limit: int = 1000) -> int:
    """The most runs whose composed ε stays within ``budget`` (binary search; ``limit`` at most)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rdp_epsilon([run] * mid, DELTA) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    q = BATCH / N
    steps = ROUNDS * steps_per_round(N, BATCH, EPOCHS, 0)
    lines = ["# Lifetime ε after k runs (the RDP accountant's composition)", "",
             f"One run: N = {N} training samples, batch {BATCH} (q = {q:.4f}), {ROUNDS} rounds of one epoch = "
             f"{steps} DP steps; δ = {DELTA:g}. Command: `.venv/bin/python bench/privacy/composition.py "
             "--out bench/privacy/results/composition.md`.", "",
             "| ε per run | noise multiplier | " + " | ".join(f"after {k} run{'s' if k > 1 else ''}" for k in RUNS) + " | "
             + " | ".join(f"runs within {b:g}" for b in LIFETIMES) + " |",
             "|---" * (2 + len(RUNS) + len(LIFETIMES)) + "|"]
    for target in TARGETS:
        sigma = noise_for_epsilon(target, q, steps, DELTA)
        run = (sigma, q, steps)
        eps = [rdp_epsilon([run] * k, DELTA) for k in RUNS]
        fit = [runs_within(b, run) for b in LIFETIMES]
        lines.append(f"| {target:g} | {sigma:.3f} | " + " | ".join(f"{e:.2f}" for e in eps) + " | "
                     + " | ".join(str(f) for f in fit) + " |")
    one = (noise_for_epsilon(1.0, q, steps, DELTA), q, steps)
    lines += ["", f"100 runs at ε = 1 each compose to ε = {rdp_epsilon([one] * 100, DELTA):.1f}, not "
              f"{math.fsum([1.0] * 100):g}: RDP adds up over the runs and its conversion to (ε, δ) grows about as "
              "the square root of the number of runs."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
