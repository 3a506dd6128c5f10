"""Benchmark of DecHW (the DecHW paper) against DecHetero and CFA, and of the DecHW† cut-off.

Reproduces the *shape* of the DecHW paper's Tables I, II and V and Fig. 4 at a scale that
fits a small CPU machine: Erdős–Rényi p = 0.2 graphs, Dirichlet label skew
α ∈ {1, 0.5, 0.2}, independent initialisations, datasets HAR and digits, several
seeds.  Every run is one ``dfl_agent.runtime.node.simulator.simulate`` call.

Writes (``--out``, default ``bench/dechw/results``):

- ``runs.json``: per run the mean-over-nodes accuracy curve, final per-node spread,
  bytes per round and wall time (enough to recompute every table);
- ``results.json`` and ``results.md``: Table I (final accuracy, mean over nodes ±
  std over seeds), Table II (rounds to reach 50/75/90 % of the best accuracy),
  DecHW vs DecHW† (accuracy, bytes), the acceptance checks;
- ``accuracy.png``: mean accuracy per round, one panel per (dataset, α).

Usage (from the repository root)::

    nice -n 10 .venv/bin/python bench/dechw/run.py            # the committed run
    nice -n 10 .venv/bin/python bench/dechw/run.py --quick    # smoke test, ~1 min

Per-node metrics of every run go to ``--work`` (default ``/tmp/dechw_bench``), not
committed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dfl_agent.cli.progress import simulate_with_progress as simulate  # noqa: E402  (progress on stderr)
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.runtime.node.metrics import read_jsonl  # noqa: E402
from dfl_agent.runtime.node.simulator import SimConfig  # noqa: E402

METHODS = ("dechw", "dechetero", "cfa", "dechw_dagger")
LABELS = {"dechw": "DecHW", "dechetero": "DecHetero", "cfa": "CFA", "dechw_dagger": "DecHW†"}
LEVELS = (0.5, 0.75, 0.9)

# Per data set: local training and model.  The paper trains 5 epochs per round with
# lr 0.001-0.01 for 1000 rounds; we have tens of rounds, so the learning rate is larger.
DATASETS: dict[str, dict[str, Any]] = {
    "digits": {"train": dict(epochs=5, batch_size=32, lr=0.05, momentum=0.5), "model_size": "medium"},
    "har": {"train": dict(epochs=1, batch_size=32, lr=0.05, momentum=0.5), "model_size": "small"},
}


def _stratified(y: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a stratified random subset of ``size`` labels (all if size >= len(y))."""
    if size <= 0 or size >= len(y):
        return np.arange(len(y))
    keep = np.concatenate([
        rng.choice(np.flatnonzero(y == c), size=int(round(size * np.mean(y == c))), replace=False)
        for c in np.unique(y)
    ])
    return np.sort(keep)


def har_dir(work: Path, pool_size: int, test_size: int) -> Path:
    """HAR as a device data directory (``npz`` loader) with stratified, fixed (seed 0)
    subsets of ``pool_size`` training-pool and ``test_size`` test samples (0 = all),
    to fit the compute budget: the simulator trains on the whole pool every round."""
    from dfl_agent.data import load_dataset

    d = work / f"har_pool{pool_size}_test{test_size}"
    if (d / "train.npz").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    b = load_dataset("har")
    rng = np.random.default_rng(0)
    keep_pool = _stratified(b.pool.y, pool_size, rng)
    keep_test = _stratified(b.test.y, test_size, rng)
    np.savez(d / "train.npz", x=b.pool.x[keep_pool], y=b.pool.y[keep_pool], groups=b.pool.groups[keep_pool])
    np.savez(d / "test.npz", x=b.test.x[keep_test], y=b.test.y[keep_test])
    (d / "meta.json").write_text(json.dumps({"name": "har", "class_names": list(b.pool.class_names)}))
    return d


def sim_config(method: str, dataset: str, alpha: float, seed: int, a: argparse.Namespace, work: Path) -> SimConfig:
    spec = DATASETS[dataset]
    algorithm, options = method, {}
    if method == "dechw_dagger":
        algorithm, options = "dechw", {"theta": a.theta}
    ds, path = dataset, None
    if dataset == "har" and (a.har_pool > 0 or a.har_test > 0):
        ds, path = "npz", str(har_dir(work, a.har_pool, a.har_test))
    return SimConfig(
        algorithm=algorithm, nodes=a.nodes, rounds=a.rounds, dataset=ds, dataset_path=path,
        partition="dirichlet", beta=alpha, seed=seed, options=options, train=TrainConfig(**spec["train"]),
        model_size=spec["model_size"], init="independent", topology="erdos_renyi",
        topology_options={"p": a.p}, threads=1, out=str(work / f"{dataset}_a{alpha}_s{seed}_{method}"),
    )


def summarise_run(out: Path, rounds: int) -> dict[str, Any]:
    """Mean-over-nodes accuracy per round, final per-node accuracies, bytes sent per round."""
    acc = np.full(rounds, np.nan)
    by_round: dict[int, list[float]] = {}
    sent: dict[str, dict[int, int]] = {}
    hess_rounds: set[int] = set()
    final: dict[str, float] = {}
    for r in read_jsonl(out / "metrics.jsonl"):
        if "global_accuracy" in r:
            by_round.setdefault(r["round"], []).append(r["global_accuracy"])
            if r["round"] == rounds:
                final[r["node"]] = r["global_accuracy"]
        sent.setdefault(r["node"], {})[r["round"]] = r["bytes_sent"]
        if r.get("hessian_weighted"):
            hess_rounds.add(r["round"])
    for t, v in by_round.items():
        acc[t - 1] = float(np.mean(v))
    per_round = np.zeros(rounds)
    for recs in sent.values():
        cum = np.array([recs.get(t, 0) for t in range(1, rounds + 1)], dtype=np.float64)
        per_round += np.diff(np.concatenate([[0.0], cum]))
    return {
        "accuracy": [round(float(x), 5) for x in acc],
        "final_per_node": final,
        "final_mean": float(np.mean(list(final.values()))),
        "final_std_nodes": float(np.std(list(final.values()))),
        "bytes_per_round": [int(x) for x in per_round],
        "bytes_total": int(per_round.sum()),
        "hessian_weighted_rounds": sorted(hess_rounds),
    }


def rounds_to(curve: list[float], target: float) -> int | None:
    """First round (1-based) whose mean accuracy reaches ``target``; None if never."""
    for i, v in enumerate(curve):
        if v >= target:
            return i + 1
    return None


def analyse(runs: dict[str, dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Tables I, II, the DecHW† comparison and the acceptance checks from ``runs``."""
    out: dict[str, Any] = {"table1": {}, "table2": {}, "dagger": {}, "acceptance": {}}
    for dataset in a.datasets:
        for alpha in a.alphas:
            key = f"{dataset} α={alpha}"
            t1, t2 = {}, {}
            per_seed_best = {
                s: max(max(runs[f"{dataset}_a{alpha}_s{s}_{m}"]["accuracy"]) for m in a.methods) for s in a.seeds
            }
            for m in a.methods:
                finals = [runs[f"{dataset}_a{alpha}_s{s}_{m}"]["final_mean"] for s in a.seeds]
                last10 = [float(np.mean(runs[f"{dataset}_a{alpha}_s{s}_{m}"]["accuracy"][-10:])) for s in a.seeds]
                t1[m] = {"mean": float(np.mean(finals)), "std_seeds": float(np.std(finals)),
                         "last10_mean": float(np.mean(last10)), "last10_std_seeds": float(np.std(last10)),
                         "per_seed": finals}
                t2[m] = {}
                for lv in LEVELS:
                    reached = [rounds_to(runs[f"{dataset}_a{alpha}_s{s}_{m}"]["accuracy"], lv * per_seed_best[s])
                               for s in a.seeds]
                    ok = [r for r in reached if r is not None]
                    t2[m][str(lv)] = {"mean": float(np.mean(ok)) if len(ok) == len(reached) else None,
                                      "per_seed": reached}
            out["table1"][key], out["table2"][key] = t1, t2
            out["table2"][key]["best_accuracy_per_seed"] = per_seed_best
            if "dechw" in a.methods and "dechw_dagger" in a.methods:
                d = {}
                for m in ("dechw", "dechw_dagger"):
                    rr = [runs[f"{dataset}_a{alpha}_s{s}_{m}"] for s in a.seeds]
                    d[m] = {
                        "final_mean": float(np.mean([r["final_mean"] for r in rr])),
                        "bytes_total": float(np.mean([r["bytes_total"] for r in rr])),
                        "bytes_after_theta": float(np.mean([sum(r["bytes_per_round"][a.theta:]) for r in rr])),
                    }
                d["accuracy_diff_points"] = 100 * (d["dechw_dagger"]["final_mean"] - d["dechw"]["final_mean"])
                d["bytes_ratio_total"] = d["dechw_dagger"]["bytes_total"] / d["dechw"]["bytes_total"]
                d["bytes_ratio_after_theta"] = (d["dechw_dagger"]["bytes_after_theta"] / d["dechw"]["bytes_after_theta"]
                                                if d["dechw"]["bytes_after_theta"] else None)
                out["dagger"][key] = d
            if "dechw" in a.methods and "dechetero" in a.methods:
                hw, het = t2["dechw"], t2["dechetero"]
                faster = {}
                for lv in ("0.5", "0.75"):
                    h, e = hw[lv]["mean"], het[lv]["mean"]
                    faster[lv] = h is not None and (e is None or h < e)
                out["acceptance"][key] = {
                    "dechw_faster_50": faster["0.5"], "dechw_faster_75": faster["0.75"],
                    "dechw_final_ge_dechetero": t1["dechw"]["mean"] >= t1["dechetero"]["mean"],
                    "dagger_within_1_point": (abs(out["dagger"][key]["accuracy_diff_points"]) <= 1.0
                                              if key in out["dagger"] else None),
                    "dagger_at_most_1_point_worse": (out["dagger"][key]["accuracy_diff_points"] >= -1.0
                                                     if key in out["dagger"] else None),
                }
    return out


def fmt_rounds(v: dict[str, Any]) -> str:
    if v["mean"] is not None:
        return f"{v['mean']:.1f}"
    reached = sum(r is not None for r in v["per_seed"])
    return f"— ({reached}/{len(v['per_seed'])})"


def write_markdown(res: dict[str, Any], a: argparse.Namespace, path: Path) -> None:
    L = []
    L.append(f"# DecHW benchmark results\n\n{a.nodes} nodes, Erdős–Rényi p = {a.p}, {a.rounds} rounds, "
             f"independent initialisation, seeds {a.seeds}, DecHW† θ = {a.theta}.  Generated by "
             f"`bench/dechw/run.py`; see README.md for the command and the settings.\n")
    L.append("## Table I: final global accuracy (%), mean over nodes ± std over seeds\n")
    cols = [f"{d} α={al}" for d in a.datasets for al in a.alphas]
    L.append("| method | " + " | ".join(cols) + " |")
    L.append("|---" * (len(cols) + 1) + "|")
    for m in a.methods:
        cells = []
        for c in cols:
            v = res["table1"][c][m]
            best = max(res["table1"][c][k]["mean"] for k in a.methods)
            s = f"{100 * v['mean']:.2f} ± {100 * v['std_seeds']:.2f}"
            cells.append(f"**{s}**" if v["mean"] == best else s)
        L.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    L.append("\nMean over nodes and over the last 10 rounds (the paper's Table I definition), ± std over seeds:\n")
    L.append("| method | " + " | ".join(cols) + " |")
    L.append("|---" * (len(cols) + 1) + "|")
    for m in a.methods:
        cells = []
        for c in cols:
            v = res["table1"][c][m]
            cells.append(f"{100 * v['last10_mean']:.2f} ± {100 * v['last10_std_seeds']:.2f}")
        L.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    L.append("\n## Table II: rounds to reach 50 / 75 / 90 % of the best accuracy (mean over seeds)\n")
    L.append("Best accuracy = the highest mean-over-nodes accuracy any method reached in any round, per seed. "
             "\"— (k/n)\": reached in only k of the n seeds within the run.\n")
    L.append("| data set, α | method | 50 % | 75 % | 90 % |")
    L.append("|---|---|---|---|---|")
    for c in cols:
        for m in a.methods:
            t = res["table2"][c][m]
            L.append(f"| {c} | {LABELS[m]} | " + " | ".join(fmt_rounds(t[str(lv)]) for lv in LEVELS) + " |")
    if res["dagger"]:
        L.append(f"\n## DecHW vs DecHW† (θ = {a.theta}): accuracy and bytes (mean over seeds)\n")
        L.append("| data set, α | DecHW acc % | DecHW† acc % | Δ points | DecHW MB | DecHW† MB | ratio (all) | "
                 f"ratio after round {a.theta} |")
        L.append("|---|---|---|---|---|---|---|---|")
        for c, d in res["dagger"].items():
            L.append(f"| {c} | {100 * d['dechw']['final_mean']:.2f} | {100 * d['dechw_dagger']['final_mean']:.2f} | "
                     f"{d['accuracy_diff_points']:+.2f} | {d['dechw']['bytes_total'] / 1e6:.1f} | "
                     f"{d['dechw_dagger']['bytes_total'] / 1e6:.1f} | {d['bytes_ratio_total']:.3f} | "
                     f"{d['bytes_ratio_after_theta']:.3f} |")
    if res["acceptance"]:
        L.append("\n## The paper's claims, checked\n")
        L.append("| data set, α | DecHW faster to 50 % | faster to 75 % | final ≥ DecHetero | DecHW† within ±1 point | "
                 "DecHW† at most 1 point worse |")
        L.append("|---|---|---|---|---|---|")
        yn = {True: "yes", False: "**no**", None: "n/a"}
        for c, v in res["acceptance"].items():
            L.append(f"| {c} | {yn[v['dechw_faster_50']]} | {yn[v['dechw_faster_75']]} | "
                     f"{yn[v['dechw_final_ge_dechetero']]} | {yn[v['dagger_within_1_point']]} | "
                     f"{yn[v['dagger_at_most_1_point_worse']]} |")
    L.append(f"\nWall time of the whole benchmark: {res['wall_seconds'] / 60:.1f} min on {res['machine']}.\n")
    path.write_text("\n".join(L) + "\n")


def plot(runs: dict[str, dict[str, Any]], a: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(a.datasets), len(a.alphas), figsize=(4.2 * len(a.alphas), 3.4 * len(a.datasets)),
                             dpi=100, squeeze=False, sharex=True)
    styles = {"dechw": ("C0", "-"), "dechetero": ("C1", "-"), "cfa": ("C2", "-"), "dechw_dagger": ("C3", "--")}
    for i, dataset in enumerate(a.datasets):
        for j, alpha in enumerate(a.alphas):
            ax = axes[i][j]
            for m in a.methods:
                curves = np.array([runs[f"{dataset}_a{alpha}_s{s}_{m}"]["accuracy"] for s in a.seeds])
                mu, sd = curves.mean(0), curves.std(0)
                x = np.arange(1, len(mu) + 1)
                c, ls = styles[m]
                ax.plot(x, 100 * mu, color=c, linestyle=ls, label=LABELS[m])
                ax.fill_between(x, 100 * (mu - sd), 100 * (mu + sd), color=c, alpha=0.15)
            if "dechw_dagger" in a.methods:
                ax.axvline(a.theta, color="grey", linewidth=0.8, linestyle=":")
            ax.set_title(f"{dataset}, Dir({alpha})")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("global accuracy (%)")
            if i == len(a.datasets) - 1:
                ax.set_xlabel("round")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Mean accuracy over {a.nodes} nodes (± std over {len(a.seeds)} seeds), Erdős–Rényi p={a.p}, "
                 "independent init", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--p", type=float, default=0.2, help="Erdős–Rényi edge probability")
    p.add_argument("--theta", type=int, default=30, help="DecHW† cut-off round")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.5, 0.2])
    p.add_argument("--datasets", nargs="+", default=["har", "digits"], choices=sorted(DATASETS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--har-pool", type=int, default=3000, help="HAR pool samples (stratified subset; 0 = all 7415)")
    p.add_argument("--har-test", type=int, default=1000, help="HAR test samples (stratified subset; 0 = all 2996)")
    p.add_argument("--out", default=str(ROOT / "bench/dechw/results"))
    p.add_argument("--work", default="/tmp/dechw_bench")
    p.add_argument("--quick", action="store_true", help="smoke test: 10 nodes, 12 rounds, θ = 6, one seed")
    p.add_argument("--from-runs", default=None, metavar="RUNS_JSON",
                   help="recompute the tables and the plot from a runs.json (no simulation)")
    a = p.parse_args(argv)
    if a.quick:
        a.nodes, a.rounds, a.theta, a.seeds, a.p = 10, 12, 6, [0], 0.3
    torch.set_num_threads(1)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: dict[str, dict[str, Any]] = json.loads(Path(a.from_runs).read_text()) if a.from_runs else {}
    todo = [(d, al, s, m) for d in a.datasets for al in a.alphas for s in a.seeds for m in a.methods]
    for k, (dataset, alpha, seed, method) in enumerate(todo, 1):
        if f"{dataset}_a{alpha}_s{seed}_{method}" in runs:
            continue
        cfg = sim_config(method, dataset, alpha, seed, a, work)
        t0 = time.time()
        summary = simulate(cfg)
        run = summarise_run(Path(cfg.out), a.rounds)
        run["wall_seconds"] = round(time.time() - t0, 1)
        run["summary_global_accuracy"] = summary["global_accuracy"]["mean"]
        runs[f"{dataset}_a{alpha}_s{seed}_{method}"] = run
        print(f"[{k}/{len(todo)}] {dataset} α={alpha} seed={seed} {LABELS[method]}: final "
              f"{100 * run['final_mean']:.2f}%, {run['bytes_total'] / 1e6:.1f} MB, {run['wall_seconds']} s "
              f"(elapsed {(time.time() - started) / 60:.1f} min)", flush=True)
    res = analyse(runs, a)
    res["wall_seconds"] = time.time() - started
    previous = Path(a.from_runs).with_name("results.json") if a.from_runs else None
    if previous is not None and previous.exists():  # re-analysis: keep the measured wall time and command
        old = json.loads(previous.read_text())
        res["wall_seconds"], command = old["wall_seconds"], old["settings"]["command"]
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    res["settings"] = {
        "nodes": a.nodes, "rounds": a.rounds, "p": a.p, "theta": a.theta, "seeds": a.seeds, "alphas": a.alphas,
        "datasets": {d: DATASETS[d] for d in a.datasets}, "har_pool_samples": a.har_pool, "har_test_samples": a.har_test, "init": "independent",
        "partition": "dirichlet", "command": "nice -n 10 .venv/bin/python bench/dechw/run.py " + " ".join(argv or sys.argv[1:]),
    }
    if previous is not None and previous.exists():
        res["settings"]["command"] = command
    (out / "runs.json").write_text(json.dumps(runs, indent=1, default=float) + "\n")
    (out / "results.json").write_text(json.dumps(res, indent=2, default=lambda x: None if x is None else float(x)) + "\n")
    write_markdown(res, a, out / "results.md")
    plot(runs, a, out / "accuracy.png")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
