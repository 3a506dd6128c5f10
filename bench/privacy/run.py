"""Accuracy against the privacy budget ε: FedAvg and DFML on HAR by user, with DP-SGD.

One run = ``dflctl simulate --dataset har --partition by-user`` (NODES nodes, ROUNDS rounds,
one torch thread) with ``--dp-epsilon E --dp-max-grad-norm C`` (ε spent by each node's whole
run, δ = 1e-5), or without DP (ε = ∞).  Each run's figures are saved in
``results/runs/<alg>_eps<E>_C<C>_s<seed>.json`` as soon as it ends; a rerun skips the runs
already there.

The clipping bound C is chosen from {0.5, 1, 2} per (algorithm, ε) on *validation* data only:
the mean over nodes of the deployable model's accuracy on the node's own held-out split
(``local_accuracy`` in summary.json) after the last round of seed 0.  The test accuracy (the
held-out users, ``global_accuracy``) never enters the choice.

Usage (from the repository root)::

    nice -n 19 .venv/bin/python bench/privacy/run.py select   # seed 0, every (alg, ε, C)
    nice -n 19 .venv/bin/python bench/privacy/run.py grid     # seeds 0-2 at the chosen C, and no DP
    .venv/bin/python bench/privacy/run.py report              # results/accuracy.md, results/clip_choice.md

``--only fedavg`` restricts to one algorithm, ``--seeds 0,1`` and ``--eps 8`` to some seeds and
budgets (what ran is in each run's file and in the report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUNS = RESULTS / "runs"
ROOT = HERE.parents[1]

NODES, ROUNDS = 5, 20
ALGORITHMS = ("fedavg", "dfml", "dfml-h2")
#: the registry name of each benchmarked setting, and its further dflctl simulate arguments:
#: ``dfml-h2`` is DFML with its paper's H2 models (five different CNNs) instead of the default CNN
ALGORITHM = {"fedavg": "fedavg", "dfml": "dfml", "dfml-h2": "dfml"}
EXTRA = {"fedavg": (), "dfml": (), "dfml-h2": ("--models", "H2")}
#: learning rates: fedavg the simulator's default; DFML the rate its own benchmark chose on
#: validation for HAR by user (bench/dfml/results/lr_selection.md, har-byuser-H2: 0.01)
LR = {"fedavg": 0.05, "dfml": 0.01, "dfml-h2": 0.01}
#: algorithm options: DFML with 2 mutual-learning epochs a round instead of 10, with and without
#: DP (a DP step costs about twice a plain one and every mutual-learning epoch is DP steps: 10
#: epochs made one DP run of 5 nodes take over 10 minutes on the shared 2-core machine)
OPTIONS = {"fedavg": (), "dfml": ("mutual_epochs=2",), "dfml-h2": ("mutual_epochs=2",)}
EPSILONS = (1.0, 3.0, 8.0)
CLIPS = (0.5, 1.0, 2.0)
SEEDS = (0, 1, 2)
DELTA = 1e-5


def _name(alg: str, eps: float | None, clip: float | None, seed: int) -> str:
    return f"{alg}_eps{'inf' if eps is None else f'{eps:g}'}_C{'-' if clip is None else f'{clip:g}'}_s{seed}"


def command(alg: str, eps: float | None, clip: float | None, seed: int) -> list[str]:
    cmd = ["dflctl", "simulate", "--algorithm", ALGORITHM[alg], *EXTRA[alg], "--nodes", str(NODES),
           "--rounds", str(ROUNDS), "--dataset", "har", "--partition", "by-user", "--seed", str(seed), "--lr", f"{LR[alg]:g}"]
    for opt in OPTIONS[alg]:
        cmd += ["--option", opt]
    if eps is not None:
        cmd += ["--dp-epsilon", f"{eps:g}", "--dp-max-grad-norm", f"{clip:g}", "--dp-delta", f"{DELTA:g}"]
    return cmd


def run_one(alg: str, eps: float | None, clip: float | None, seed: int) -> dict[str, Any]:
    """Run (or read back) one simulation; returns its saved figures."""
    path = RUNS / f"{_name(alg, eps, clip, seed)}.json"
    if path.exists():
        return json.loads(path.read_text())
    cmd = command(alg, eps, clip, seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.time(), os.times()
        r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *cmd[1:], "--out", tmp, "--no-progress"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        c1 = os.times()
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        s = json.loads((Path(tmp) / "summary.json").read_text())
    dp = s.get("dp") or {}
    res = {
        "algorithm": alg, "epsilon_target": eps, "max_grad_norm": clip, "seed": seed, "nodes": NODES,
        "rounds": s["rounds_completed"], "lr": LR[alg], "options": list(OPTIONS[alg]),
        "test_accuracy": s["global_accuracy"]["mean"], "test_accuracy_per_node": s["global_accuracy"]["per_node"],
        "validation_accuracy": s["local_accuracy"]["mean"],
        "dp": dp, "wall_seconds": round(time.time() - t0, 1),
        "cpu_seconds": round((c1.children_user + c1.children_system) - (c0.children_user + c0.children_system), 1),
        "command": " ".join(cmd),
    }
    RUNS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{path.name}: test {res['test_accuracy']:.4f} validation {res['validation_accuracy']:.4f} "
          f"eps spent {dp.get('epsilon_spent')} in {res['wall_seconds']} s", flush=True)
    return res


def _runs() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))]


def chosen_clip(alg: str, eps: float) -> float | None:
    """C with the highest seed-0 validation accuracy among the runs present (ties: the smaller C)."""
    cands = [r for r in _runs() if r["algorithm"] == alg and r["epsilon_target"] == eps and r["seed"] == 0]
    if not cands:
        return None
    best = max(cands, key=lambda r: (r["validation_accuracy"], -r["max_grad_norm"]))
    return float(best["max_grad_norm"])


def report() -> str:
    runs = _runs()
    lines = ["# Clipping bound per (algorithm, ε), chosen on validation", "",
             "Seed 0; validation = mean over nodes of the deployable model's accuracy on the node's own held-out "
             "split after the last round (`local_accuracy`); test = the held-out users (`global_accuracy`), shown "
             "only to judge the choice afterwards.", "",
             "| algorithm | ε | C | validation | test | ε spent (max over nodes) | noise multiplier | chosen |",
             "|---|---|---|---|---|---|---|---|"]
    tried = {(r["algorithm"], r["epsilon_target"]): set() for r in runs}
    for r in runs:
        if r["seed"] == 0:
            tried[(r["algorithm"], r["epsilon_target"])].add(r["max_grad_norm"])
    for alg in ALGORITHMS:
        for eps in EPSILONS:
            c = chosen_clip(alg, eps)
            for r in sorted((r for r in runs if r["algorithm"] == alg and r["epsilon_target"] == eps
                             and r["seed"] == 0), key=lambda r: r["max_grad_norm"]):
                dp = r["dp"]
                lines.append(f"| {alg} | {eps:g} | {r['max_grad_norm']:g} | {100 * r['validation_accuracy']:.1f} | "
                             f"{100 * r['test_accuracy']:.1f} | {dp.get('epsilon_spent', float('nan')):.3f} | "
                             f"{dp.get('noise_multiplier', float('nan')):.3f} | "
                             f"{('**yes**' if len(tried[(alg, eps)]) > 1 else 'only C run (not selected)') if r['max_grad_norm'] == c else ''} |")
    (RESULTS / "clip_choice.md").write_text("\n".join(lines) + "\n")
    acc = ["# Test accuracy against ε (HAR by user)", "",
           f"{NODES} nodes, {ROUNDS} rounds, δ = {DELTA:g}; test accuracy (%) on the held-out users, mean over nodes "
           "after the last round, then mean ± std over seeds (n = seeds that ran); C chosen on validation "
           "(clip_choice.md). Commands: `nice -n 19 .venv/bin/python bench/privacy/run.py select`, "
           "`run.py grid`, `run.py report`; each run's `dflctl simulate` command is in `runs/*.json`.", "",
           "| algorithm | ε = 1 | ε = 3 | ε = 8 | ε = ∞ (no DP) | ε = 8 vs no DP |", "|---|---|---|---|---|---|"]
    for alg in ALGORITHMS:
        cells, means = [], {}
        for eps in (*EPSILONS, None):
            c = None if eps is None else chosen_clip(alg, eps)
            rs = [r for r in runs if r["algorithm"] == alg and r["epsilon_target"] == eps
                  and (eps is None or r["max_grad_norm"] == c)]
            vals = [100 * r["test_accuracy"] for r in rs]
            if not vals:
                cells.append("—")
                continue
            means[eps] = statistics.mean(vals)
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{means[eps]:.1f} ± {sd:.1f} (n={len(vals)}{'' if eps is None else f', C={c:g}'})")
        gap = f"{means[8.0] - means[None]:+.1f} points" if 8.0 in means and None in means else "—"
        acc.append(f"| {alg} | {' | '.join(cells)} | {gap} |")
    (RESULTS / "accuracy.md").write_text("\n".join(acc) + "\n")
    return "\n".join(acc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("select", "grid", "report"))
    ap.add_argument("--only", choices=ALGORITHMS, default=None)
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--eps", default=",".join(f"{e:g}" for e in EPSILONS))
    ap.add_argument("--clip", type=float, default=None,
                    help="grid: the C of a budget that 'select' did not run (then not chosen on validation)")
    a = ap.parse_args(argv)
    algs = (a.only,) if a.only else ALGORITHMS
    epss = [float(e) for e in a.eps.split(",") if e]
    if a.part == "select":
        for eps in epss:
            for alg in algs:
                for clip in CLIPS:
                    run_one(alg, eps, clip, 0)
    elif a.part == "grid":
        for seed in (int(s) for s in a.seeds.split(",")):
            for alg in algs:
                run_one(alg, None, None, seed)
                for eps in epss:
                    c = chosen_clip(alg, eps) or a.clip
                    if c is None:
                        raise SystemExit(f"no seed-0 runs of {alg} at eps {eps:g}: run 'select' first (or --clip)")
                    run_one(alg, eps, c, seed)
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
