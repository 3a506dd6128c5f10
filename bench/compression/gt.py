"""Compressed synchronizations for Gradient Thresholding (the ``gt`` column of the compression benchmark).

GT (the MoDeFL thesis, ch. 5) exchanges accumulated gradients G^Σ only when an actor's vote asks for a
synchronization (kind ``gt.sync``).  Here those messages are compressed through
``[compression.kinds] "gt.sync" = SPEC`` with an error-feedback residual per stream
(Stich et al. 2018), on the setup of ``bench/gt`` (digits, 4 actors, Dirichlet α 0.25,
20 epochs; GT with the θ_β, θ_α chosen there on validation; BL1 = synchronize every epoch).
Accuracy and loss of actor 0's model on the test split, bytes of the ``gt.sync`` messages
(votes are one bit plus an envelope and are not compressed), mean over seeds 666–669.

Usage: nice -n 10 .venv/bin/python bench/compression/gt.py   (about 2 min; writes results/gt.md, results/gt.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEEDS = (666, 667, 668, 669)
SPECS = [("none", True), ("fp16", True), ("q8", True), ("q4", True), ("topk:0.1+q8", True), ("topk:0.1+q8", False),
         ("topk:0.01+q8", True), ("topk:0.01+q8", False)]
METHODS = {"BL1": ("local-steps", {"tau": 1}),
           "GT": ("gt", {"theta_rho": 1.75, "theta_beta": 0.25, "theta_alpha": 0.8})}  # bench/gt/README.md


def main() -> None:
    from bench.gt.run import run_one

    rows = []
    for method, (alg, opts) in METHODS.items():
        for spec, ef in SPECS:
            for seed in SEEDS:
                r = run_one("digits", alg, opts, seed, sync_compression=spec, error_feedback=ef)
                rows.append({"method": method, "spec": spec, "error_feedback": ef, "seed": seed,
                             "test_loss": r["test_loss"], "test_accuracy": r["test_accuracy"], "syncs": r["syncs"],
                             "sync_bytes_sent": r["comm"].get("sync_bytes_sent", 0), "model_spread": r["model_spread"]})
            print(method, spec, ef, "done", flush=True)
    (HERE / "results" / "gt.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# GT and BL1 with compressed synchronizations (digits, 4 actors, 20 epochs, seeds 666–669)", "",
             "Command: `nice -n 10 .venv/bin/python bench/compression/gt.py`. Δ and × against `none` of the same "
             "method and seed; spread = largest parameter difference between actors at the end (0 when every "
             "actor applied the same update).", "",
             "| method | spec | error feedback | test accuracy (%) | Δ acc (pt) | test loss | syncs | "
             "sync kB sent | × fewer sync bytes | spread |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        base = {r["seed"]: r for r in rows if r["method"] == method and r["spec"] == "none"}
        for spec, ef in SPECS:
            rs = [r for r in rows if r["method"] == method and r["spec"] == spec and r["error_feedback"] == ef]
            acc = [100 * r["test_accuracy"] for r in rs]
            delta = [100 * (r["test_accuracy"] - base[r["seed"]]["test_accuracy"]) for r in rs]
            ratio = [base[r["seed"]]["sync_bytes_sent"] / max(r["sync_bytes_sent"], 1) for r in rs]
            lines.append(
                f"| {method} | `{spec}` | {('on' if ef else 'off') if 'topk' in spec else '—'} | "
                f"{statistics.fmean(acc):.2f} ± {statistics.pstdev(acc):.2f} | {statistics.fmean(delta):+.2f} | "
                f"{statistics.fmean(r['test_loss'] for r in rs):.3f} | {statistics.fmean(r['syncs'] for r in rs):.1f} | "
                f"{statistics.fmean(r['sync_bytes_sent'] for r in rs) / 1e3:.1f} | {statistics.fmean(ratio):.2f} | "
                f"{max(r['model_spread'] for r in rs):.3g} |")
    (HERE / "results" / "gt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    import torch

    torch.set_num_threads(1)
    main()
