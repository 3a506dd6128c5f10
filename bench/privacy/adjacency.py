"""What the ε the device shows means for a *replaced* sample: add/remove-one against replace-one.

The privacy ledger's accountant (:mod:`dfl_agent.privacy.accountant`, Rényi DP, the same as
Opacus's ``RDPAccountant``) gives ε for data sets that differ by one sample added or removed.
Two data sets that differ by one sample *replaced* by another are a different neighbouring
relation, with a larger ε for the same noise.  This script computes both for the runs of
``composition.py`` (N = 300, batch 32, 20 rounds of one epoch: 200 DP steps at q = 32/300,
δ = 1e-5, the noise the plan picks for a per-run target of 1, 3 and 8) after 1, 5 and 10
runs, with an independent accountant: the privacy loss distribution (PLD) accountant of
Google's ``dp-accounting`` package, which supports both relations for Poisson-sampled Gaussian
steps (the RDP accountants of Opacus and ``dp-accounting`` support only add/remove-one for
Poisson sampling).  Torch-free, seconds.

``dp-accounting`` is a benchmark dependency only (the agent does not use it).  In a virtual
environment of its own, with the repository's package on the path::

    python -m venv /tmp/dpa && /tmp/dpa/bin/pip install dp-accounting
    PYTHONPATH=<a folder holding the dfl_agent package> /tmp/dpa/bin/python \\
        bench/privacy/adjacency.py --out bench/privacy/results/adjacency.md

(or ``pip install dp-accounting`` into the agent's environment and run it with that Python).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dfl_agent.privacy.accountant import noise_for_epsilon, rdp_epsilon
from dfl_agent.privacy.plan import steps_per_round

N, BATCH, EPOCHS, ROUNDS, DELTA = 300, 32, 1, 20, 1e-5
TARGETS = (1.0, 3.0, 8.0)
RUNS = (1, 5, 10)


def pld_epsilon(sigma: float, q: float, steps: int, delta: float, relation: str) -> float:
    """ε at ``delta`` of ``steps`` Poisson-sampled Gaussian steps, by dp-accounting's PLD accountant.

    ``relation``: ``"add_remove"`` or ``"replace"`` (dp-accounting's ``ADD_OR_REMOVE_ONE`` and
    ``REPLACE_ONE``)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    rel = {"add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
           "replace": dp_accounting.NeighboringRelation.REPLACE_ONE}[relation]
    acc = pld_privacy_accountant.PLDAccountant(rel)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the Markdown table (and OUT with .json)")
    a = ap.parse_args(argv)
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        print("adjacency: needs the dp-accounting package (pip install dp-accounting)", file=sys.stderr)
        return 2
    q = BATCH / N
    steps = ROUNDS * steps_per_round(N, BATCH, EPOCHS, 0)
    rows = []
    for target in TARGETS:
        sigma = noise_for_epsilon(target, q, steps, DELTA)
        for k in RUNS:
            row = {"target_epsilon_per_run": target, "noise_multiplier": round(sigma, 4), "runs": k,
                   "steps": steps * k, "shown_rdp_add_remove": rdp_epsilon([(sigma, q, steps)] * k, DELTA),
                   "pld_add_remove": pld_epsilon(sigma, q, steps * k, DELTA, "add_remove"),
                   "pld_replace_one": pld_epsilon(sigma, q, steps * k, DELTA, "replace")}
            row["replace_over_shown"] = row["pld_replace_one"] / row["shown_rdp_add_remove"]
            rows.append(row)
    lines = ["# ε for an added or removed sample (what the device shows) and for a replaced one", "",
             f"One run: N = {N}, batch {BATCH} (q = {q:.4f}), {ROUNDS} rounds of one epoch = {steps} DP steps; "
             f"δ = {DELTA:g}. Command: see `bench/privacy/adjacency.py` (dp-accounting's PLD accountant).", "",
             "| ε per run (plan) | noise multiplier | runs | shown ε (RDP, add/remove-one) "
             "| PLD, add/remove-one | PLD, replace-one | replace-one / shown |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target_epsilon_per_run']:g} | {r['noise_multiplier']:.3f} | {r['runs']} "
                     f"| {r['shown_rdp_add_remove']:.2f} | {r['pld_add_remove']:.2f} | {r['pld_replace_one']:.2f} "
                     f"| {r['replace_over_shown']:.2f} |")
    lo = min(r["replace_over_shown"] for r in rows)
    hi = max(r["replace_over_shown"] for r in rows)
    lines += ["", f"For a replaced sample ε is {lo:.2f}-{hi:.2f}× the ε the device shows (the RDP accountant's "
              "add/remove-one ε); the PLD accountant's add/remove-one ε is a little below the RDP one, "
              "which rounds up."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text, encoding="utf-8")
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
