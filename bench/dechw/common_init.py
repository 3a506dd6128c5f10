"""DecHW with a common initialisation: why it trails DecHetero, measured.

Every node starts from the same weights (``init = common``, the simulator's and the
daemon's default), HAR with Dirichlet label skew, a full graph, the simulator's default
training (1 epoch, SGD lr 0.05, momentum 0.9, the medium 1-D CNN).  Runs DecHetero and
DecHW variants, and records for every DecHW aggregation (Eq. 6-7) how the Hessian
weights p_{j,n} split each parameter between the models:

* ``own_share``: mean over parameters of p_{i,n}, the aggregating node's own weight
  (DecHetero's own weight is τ_i ≈ 1/|N_i ∪ {i}|);
* ``eff_models``: mean over parameters of 1/Σ_j p_{j,n}², the effective number of
  models a parameter is averaged over (|N_i ∪ {i}| for a uniform average, 1 when one
  model takes it all);
* ``spread``: the mean distance of the neighbourhood's models to their mean, per
  parameter (RMS), before the aggregation: how far apart the models are.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python bench/dechw/common_init.py --out bench/dechw/results/common_init
    # several seeds: one process per seed may run at once (results.json is written under a lock)
    nice -n 10 .venv/bin/python bench/dechw/common_init.py --seeds 1 --variants "DecHW (defaults)" ...
    # the table over seeds (results.md), from the stored runs:
    .venv/bin/python bench/dechw/common_init.py --summary --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import fcntl
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.learning import hessian as hess
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.simulator import SimConfig, simulate

VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (algorithm, options, init)
    "DecHetero": ("dechetero", {}, "common"),
    "DecHW (defaults)": ("dechw", {}, "common"),
    "DecHW norm=none": ("dechw", {"norm": "none"}, "common"),
    "DecHW accumulate=ema β=1 (no accumulation)": ("dechw", {"accumulate": "ema", "beta": 1.0}, "common"),
    "DecHW† θ=3": ("dechw", {"theta": 3}, "common"),
    "DecHW size_weighting=true": ("dechw", {"size_weighting": True}, "common"),
    "DecHetero, independent init": ("dechetero", {}, "independent"),
    "DecHW, independent init": ("dechw", {}, "independent"),
    "DecHW (defaults), lr 0.02": ("dechw", {}, "common"),
    "DecHetero, lr 0.02": ("dechetero", {}, "common"),
}

#: Training settings that differ from the simulator's defaults (SGD lr 0.05, momentum 0.9).
TRAIN: dict[str, dict[str, Any]] = {"DecHW (defaults), lr 0.02": {"lr": 0.02}, "DecHetero, lr 0.02": {"lr": 0.02}}


class Probe:
    """Wraps ``hess.hessian_weighted_average`` and records how it weighted the models."""

    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []
        self._orig = hess.hessian_weighted_average

    def __enter__(self) -> Probe:
        def wrapped(models, hessians, samples, *, eps=1e-12, size_weighting=False):
            seen = hessians  # the weights Eq. 6 uses (with size_weighting: Ĥ_j scaled by |D_j|)
            if size_weighting:
                seen = [{k: v * np.float32(n) for k, v in h.items()} for h, n in zip(hessians, samples)]
            own, eff, spread, count = 0.0, 0.0, 0.0, 0
            for name in models[0]:
                if not all(name in h for h in seen):
                    continue
                h = np.stack([np.asarray(hh[name], dtype=np.float64).ravel() for hh in seen])
                w = np.stack([np.asarray(m[name], dtype=np.float64).ravel() for m in models])
                s = h.sum(axis=0)
                ok = s >= eps
                if not ok.any():
                    continue
                p = h[:, ok] / s[ok]
                own += float(p[0].sum())
                eff += float((1.0 / (p ** 2).sum(axis=0)).sum())
                spread += float(((w[:, ok] - w[:, ok].mean(axis=0)) ** 2).mean(axis=0).sum())
                count += int(ok.sum())
            if count:
                self.calls.append({"own_share": own / count, "eff_models": eff / count,
                                   "spread": float(np.sqrt(spread / count)), "models": len(models)})
            return self._orig(models, hessians, samples, eps=eps, size_weighting=size_weighting)

        hess.hessian_weighted_average = wrapped
        return self

    def __exit__(self, *exc: Any) -> None:
        hess.hessian_weighted_average = self._orig


def run(name: str, a: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    algorithm, options, init = VARIANTS[name]
    extra = {"train": TrainConfig(**TRAIN[name])} if name in TRAIN else {}
    cfg = SimConfig(algorithm=algorithm, nodes=a.nodes, rounds=a.rounds, dataset="har", partition="dirichlet",
                    beta=a.beta, seed=seed, options=dict(options), init=init, eval_every=a.eval_every, threads=1,
                    **extra,
                    out=str(out / f"{algorithm}_{abs(hash(name)) % 10**6}_{init}_s{seed}"))
    t0 = time.perf_counter()
    with Probe() as probe:
        s = simulate(cfg)
    per_round = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    curve: dict[int, list[float]] = {}
    for r in per_round:
        if "global_accuracy" in r:
            curve.setdefault(r["round"], []).append(r["global_accuracy"])
    calls = probe.calls
    third = max(1, len(calls) // 3)
    agg = {k: [float(np.mean([c[k] for c in part])) if part else None
               for part in (calls[:third], calls[third:2 * third], calls[2 * third:])]
           for k in ("own_share", "eff_models", "spread")} if calls else {}
    return {"variant": name, "seed": seed, "final": s["global_accuracy"]["mean"],
            "final_std_nodes": s["global_accuracy"]["std"],
            "curve": {t: float(np.mean(v)) for t, v in sorted(curve.items())},
            "probe_thirds": agg, "aggregations": len(calls), "wall_s": round(time.perf_counter() - t0, 1)}


def _store(path: Path, r: dict[str, Any], settings: dict[str, Any]) -> None:
    """Adds run ``r`` to ``path`` (replacing the same variant and seed) under a file lock.

    Several processes (one per seed) may write the same file; the lock serialises their
    read-modify-write, and the write goes through a temporary file and a rename.
    """
    with open(Path(tempfile.gettempdir()) / "dechw_common_init.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.loads(path.read_text())["runs"] if path.exists() else []
        kept = [x for x in old if (x["variant"], x["seed"]) != (r["variant"], r["seed"])]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"settings": settings, "runs": kept + [r]}, indent=1))
        tmp.replace(path)


#: Rows of the summary table, in order (variants absent from the results are skipped).
SUMMARY_ROWS = ["DecHetero", "DecHW (defaults)", "DecHW size_weighting=true", "DecHW† θ=3",
                "DecHetero, independent init", "DecHW, independent init", "DecHetero, lr 0.02",
                "DecHW (defaults), lr 0.02"]


def summarise(runs: list[dict[str, Any]], seeds: list[int]) -> str:
    """A Markdown table of final global accuracy per variant over ``seeds``: each seed's
    value, the mean ± sample standard deviation and the min-max range, plus the mean curve
    at the evaluated rounds and, per seed, the lead of each variant over DecHetero with the
    same initialisation.  Variants missing a seed are marked, not averaged."""
    by = {(r["variant"], r["seed"]): r for r in runs}
    rounds = sorted({int(t) for r in runs for t in r["curve"]})
    head = (["variant"] + [f"seed {s}" for s in seeds] + ["mean ± std", "min-max"]
            + [f"round {t} (mean)" for t in rounds] + ["vs DecHetero, same init, per seed"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in SUMMARY_ROWS:
        got = [by.get((name, s)) for s in seeds]
        if not any(got):
            continue
        vals = [100 * g["final"] for g in got if g]
        cells = [f"{100 * g['final']:.1f}" if g else "—" for g in got]
        if len(vals) == len(seeds):
            sd = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
            cells += [f"{np.mean(vals):.1f} ± {sd:.1f}", f"{min(vals):.1f}-{max(vals):.1f}"]
        else:
            cells += [f"({len(vals)}/{len(seeds)} seeds)", ""]
        cells += [f"{np.mean([100 * g['curve'][str(t)] for g in got if g and str(t) in g['curve']]):.1f}"
                  for t in rounds]
        base = ("DecHetero, independent init" if "independent" in name
                else "DecHetero, lr 0.02" if "lr 0.02" in name else "DecHetero")
        leads = [f"{100 * (g['final'] - by[(base, s)]['final']):+.1f}" if g and (base, s) in by else "—"
                 for g, s in zip(got, seeds)]
        cells.append("—" if name == base else " / ".join(leads))
        lines.append("| " + " | ".join([name] + cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--beta", type=float, default=0.5, help="Dirichlet concentration (label skew)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="bench/dechw/results/common_init")
    p.add_argument("--summary", action="store_true",
                   help="run nothing: write results.md (a table over --seeds) from OUT/results.json")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.summary:
        table = summarise(json.loads((out / "results.json").read_text())["runs"], a.seeds)
        (out / "results.md").write_text(table)
        print(table, end="")
        return 0
    work = Path("/tmp/dechw_common_init")
    results = []
    for seed in a.seeds:
        for name in a.variants:
            r = run(name, a, seed, work)
            results.append(r)
            print(json.dumps(r), flush=True)
            _store(out / "results.json", r, vars(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
