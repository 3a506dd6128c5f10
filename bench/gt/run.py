"""Gradient Thresholding vs the local-steps baselines BL1-BL4 (the MoDeFL thesis, §5.4.2).

One run = N actors of ``gt`` or ``local-steps`` on the memory transport (virtual time,
the real wire frames, so bytes are real), then the final synchronized model's loss on
the test split (the thesis's "test loss") and on the validation split.

Data (thesis §5.4.1): the loader's pool/test split (Iris: 90 % / 10 %), 10 % of the pool
sliced off as the validation set with the run's seed, the rest distributed over the
actors with a *size-balanced* Dirichlet partition (the thesis: "the resulting partitions
are balanced in size"): every actor gets ⌊n/N⌋ (+1) samples, its class proportions
~ Dir(α·1_C), samples drawn one at a time from its proportions renormalised over the
classes that still have samples left.  All from ``stream_rng(seed, ...)``.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python bench/gt/run.py table --dataset iris      # Table 5.4
    nice -n 10 .venv/bin/python bench/gt/run.py tune --dataset digits ... # θ_β, θ_α on validation
    nice -n 10 .venv/bin/python bench/gt/run.py table --dataset digits ...

Writes ``bench/gt/results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.data import load_dataset
from dfl_agent.data.dataset import split_indices, stream_rng
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig, evaluate
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

RESULTS = Path(__file__).resolve().parent / "results"

# per data set: actors, α, epochs, lr, batch, model, θ_ρ (thesis §5.4.1-5.4.2 for iris)
SETUPS: dict[str, dict[str, Any]] = {
    "iris": {"nodes": 8, "alpha": 0.05, "epochs": 100, "lr": 0.1, "batch": 32, "theta_rho": 2.0,
             "taus": [1, 2, 5, 10], "spec": {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 3}},
    "digits": {"nodes": 4, "alpha": 0.25, "epochs": 20, "lr": 0.4, "batch": 64, "theta_rho": 1.75,
               "taus": [1, 2, 5, 8],
               "spec": {"type": "mlp", "input_shape": [1, 8, 8], "hidden": [64], "num_classes": 10}},
    "har": {"nodes": 4, "alpha": 0.25, "epochs": 12, "lr": 0.2, "batch": 64, "theta_rho": 1.75,
            "taus": [1, 2, 5, 8],
            "spec": {"type": "cnn1d", "in_channels": 3, "length": 128, "channels": [8, 16, 32], "kernel": 5,
                     "num_classes": 6}},
}

# Table 5.4 of the thesis (Iris): (loss, syncs) per seed 666..669
THESIS_IRIS = {
    "BL1": [(0.539029, 100), (0.501504, 100), (0.474516, 100), (0.487596, 100)],
    "BL2": [(0.515485, 51), (0.563500, 51), (0.508835, 51), (0.450143, 51)],
    "BL3": [(0.516858, 21), (0.556961, 21), (0.609173, 21), (0.481423, 21)],
    "BL4": [(0.578848, 11), (0.681120, 11), (0.776382, 11), (0.523183, 11)],
    "GT": [(0.526247, 92), (0.587449, 28), (0.473216, 90), (0.385178, 90)],
}


def balanced_dirichlet(y: np.ndarray, nodes: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Size-balanced Dirichlet label-skew partition (see the module docstring)."""
    classes = np.unique(y)
    pools = {int(c): list(rng.permutation(np.flatnonzero(y == c))) for c in classes}
    sizes = [len(y) // nodes + (1 if i < len(y) % nodes else 0) for i in range(nodes)]
    parts: list[list[int]] = [[] for _ in range(nodes)]
    props = rng.dirichlet(np.full(len(classes), alpha), size=nodes)
    for i in range(nodes):
        for _ in range(sizes[i]):
            avail = np.array([len(pools[int(c)]) > 0 for c in classes], dtype=np.float64)
            p = props[i] * avail
            p = p / p.sum() if p.sum() > 0 else avail / avail.sum()
            c = int(classes[rng.choice(len(classes), p=p)])
            parts[i].append(int(pools[c].pop()))
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def prepare(dataset: str, seed: int, nodes: int, alpha: float):
    """(train parts, val set, test set) for one seed."""
    bundle = load_dataset(dataset)
    pool = bundle.pool
    keep, val = split_indices(pool.y, 0.1, stream_rng(seed, "gt-bench/validation"))
    train = pool.subset(np.sort(keep))
    valset = pool.subset(np.sort(val))
    parts = balanced_dirichlet(train.y, nodes, alpha, stream_rng(seed, "gt-bench/partition"))
    return train, parts, valset, bundle.test


def keras_init(alg: Any, seed: int) -> None:
    """Re-initialise an actor's model as Keras's Dense layers do by default (the thesis's
    models are Keras models): Glorot-uniform weights U(±sqrt(6/(fan_in+fan_out))), zero
    biases, drawn from ``seed`` (the same for every actor), and restart its reference M_R
    there.  Only linear layers (the Iris MLP); other layers keep torch's initialisation."""
    g = torch.Generator().manual_seed(int(seed))
    for m in alg.model.modules():
        if isinstance(m, torch.nn.Linear):
            lim = math.sqrt(6.0 / (m.in_features + m.out_features))
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.weight.shape, generator=g, dtype=m.weight.dtype) * 2 * lim - lim)
                if m.bias is not None:
                    m.bias.zero_()
    alg.reference = model_to_numpy(alg.model)


def run_one(dataset: str, algorithm: str, options: dict[str, Any], seed: int, **over: Any) -> dict[str, Any]:
    """One federation run; returns losses, synchronizations and communication.

    ``over`` overrides the data set's setup; ``init="keras"`` re-initialises the models
    with :func:`keras_init` (default ``"torch"``: the model registry's initialisation)."""
    setup = {**SETUPS[dataset], **over}
    train, parts, valset, test = prepare(dataset, seed, setup["nodes"], setup["alpha"])
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, options)
    cfg = TrainConfig(epochs=1, batch_size=setup["batch"], lr=setup["lr"], momentum=0.0)
    policy = None  # compress the synchronized gradients (kind gt.sync), residuals per stream
    if setup.get("sync_compression", "none") != "none":
        from dfl_agent.learning.compression import CompressionPolicy

        policy = CompressionPolicy.from_config("none", {"gt.sync": setup["sync_compression"]},
                                               error_feedback=setup.get("error_feedback", True))
    net = MemoryNetwork()
    algs = []
    for i, idx in enumerate(parts):
        nid = f"a{i}"
        data = types.SimpleNamespace(train_x=train.x[idx], train_y=train.y[idx], val_x=valset.x[:0],
                                     val_y=valset.y[:0], num_classes=train.num_classes)
        ctx = RuntimeContext(node_id=nid, federation="gt", transport=net.transport(nid, "gt"),
                             peers=PeerTable(nid, "gt"), data=data, model_spec=setup["spec"], train=cfg,
                             init_seed=seed, rng=np.random.default_rng([seed, i]), seed=seed, compression=policy)
        algs.append(cls(ctx, opts))

    async def main() -> None:
        for a in algs:
            await a.ctx.start()
        for a in algs:
            await a.setup()
            if setup.get("init", "torch") == "keras":
                keras_init(a, seed)
        await asyncio.gather(*(a.run(setup["epochs"]) for a in algs))
        for a in algs:
            await a.ctx.stop()

    t0 = time.time()
    run_virtual(main())
    wall = time.time() - t0
    models = [a.deployable_model() for a in algs]
    ref = {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    spread = max(float((m.state_dict()[k] - ref[k]).abs().max()) for m in models for k in ref)
    te = evaluate(models[0], test.x, test.y)
    va = evaluate(models[0], valset.x, valset.y)
    comm: dict[str, int] = {}
    for a in algs:
        for k, v in getattr(a, "test_counts", {}).items():
            comm[f"tests_{k}"] = comm.get(f"tests_{k}", 0) + int(v)
        for k, v in a.comm.items():
            comm[k] = comm.get(k, 0) + int(v)
    return {
        "dataset": dataset, "algorithm": algorithm, "options": options, "seed": seed,
        "test_loss": te["loss"], "test_accuracy": te["accuracy"], "val_loss": va["loss"],
        "val_accuracy": va["accuracy"], "syncs": algs[0].syncs, "model_spread": spread,
        "bytes_sent": sum(a.ctx.transport.stats.bytes_sent for a in algs),
        "bytes_received": sum(a.ctx.transport.stats.bytes_received for a in algs),
        "comm": comm, "wall_s": wall, "setup": {k: v for k, v in setup.items()},
    }


def front_loss(points: list[tuple[int, float]], syncs: int) -> float:
    """The baselines' loss-vs-synchronizations front at ``syncs``: the lower envelope of
    the points, interpolated linearly between the two baselines around ``syncs``;
    outside their range, the best loss among baselines with at most ``syncs``."""
    pts = sorted(points)
    # lower envelope: running minimum from few to many synchronizations
    env, best = [], float("inf")
    for n, l in pts:
        best = min(best, l)
        env.append((n, best))
    below = [(n, l) for n, l in env if n <= syncs]
    above = [(n, l) for n, l in env if n >= syncs]
    if not below:
        return float("inf")  # GT synchronizes less than every baseline: no baseline to compare
    if not above:
        return below[-1][1]
    (n0, l0), (n1, l1) = below[-1], above[0]
    return l0 if n1 == n0 else l0 + (l1 - l0) * (syncs - n0) / (n1 - n0)


def variants(dataset: str, gt_options: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    s = SETUPS[dataset]
    out = {f"BL{i + 1}": ("local-steps", {"tau": tau}) for i, tau in enumerate(s["taus"])}
    out["GT"] = ("gt", {"theta_rho": s["theta_rho"], **gt_options})
    return out


def _fmt(x: float) -> str:
    return f"{x:.4f}"


def cmd_table(a: argparse.Namespace) -> None:
    seeds = [int(s) for s in a.seeds.split(",")]
    gt_opts = json.loads(a.gt_options)
    over = json.loads(a.override)
    rows: dict[str, list[dict[str, Any]]] = {}
    if a.merge:  # reuse the baselines of an earlier table (same data set and seeds)
        prev = json.loads((RESULTS / f"{a.merge}.json").read_text())
        assert prev["seeds"] == seeds and prev["dataset"] == a.dataset
        rows = {n: rs for n, rs in prev["rows"].items() if n != "GT"}
    for name, (alg, opts) in variants(a.dataset, gt_opts).items():
        if name in rows:
            continue
        for seed in seeds:
            r = run_one(a.dataset, alg, opts, seed, **over)
            rows.setdefault(name, []).append(r)
            print(f"{name} seed {seed}: test loss {r['test_loss']:.4f} syncs {r['syncs']} "
                  f"bytes {r['bytes_sent']} ({r['wall_s']:.1f}s)", flush=True)
    name = a.name or f"table_{a.dataset}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "dataset": a.dataset, "seeds": seeds, "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    report(name)


def _front_lines(rows: dict[str, list[dict[str, Any]]], seeds: list[int], key: str, unit: str) -> list[str]:
    lines = []
    for i, seed in enumerate(seeds):
        g = rows["GT"][i]
        base = {n: rs[i] for n, rs in rows.items() if n != "GT"}
        dom = [n for n, r in base.items() if r["test_loss"] <= g["test_loss"] and r[key] <= g[key]
               and (r["test_loss"] < g["test_loss"] or r[key] < g[key])]
        front = front_loss([(r[key], r["test_loss"]) for r in base.values()], g[key])
        where = "below" if g["test_loss"] < front else "on" if g["test_loss"] == front else "above"
        amount = g[key] / 1e6 if key == "bytes_sent" else g[key]
        lines.append(f"- seed {seed}: GT loss {g['test_loss']:.4f} at {amount:g} {unit}; baseline front there "
                     f"{front:.4f} -> GT **{where}** the front; "
                     + (f"dominated by {', '.join(dom)}" if dom else "not dominated by any baseline"))
    return lines


def report(name: str) -> None:
    """Write ``results/<name>.md`` from ``results/<name>.json``."""
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    rows, seeds, dataset = doc["rows"], doc["seeds"], doc["dataset"]
    g0 = rows["GT"][0]
    lines = [f"# {dataset}: test loss / synchronizations / bytes (ours)", "",
             f"command: `{doc['command']}`", "",
             f"setup: {json.dumps(g0['setup'])}; GT options {json.dumps(g0['options'])}", "",
             "MB sent = bytes put on the wire by all actors together (a broadcast counts once; "
             "envelopes and GT's votes included).", ""]
    head = "| exp | " + " | ".join(f"seed {s} loss | sync | MB sent" for s in seeds) + " |"
    lines += [head, "|" + "---|" * (1 + 3 * len(seeds))]
    for name_, rs in rows.items():
        cells = " | ".join(f"{_fmt(r['test_loss'])} | {r['syncs']} | {r['bytes_sent'] / 1e6:.3f}" for r in rs)
        lines.append(f"| {name_} | {cells} |")
    if dataset == "iris" and seeds == [666, 667, 668, 669]:
        lines += ["", "Thesis Table 5.4 (same layout):", "", "| exp | " + " | ".join(
            f"seed {s} loss | sync" for s in seeds) + " |", "|" + "---|" * (1 + 2 * len(seeds))]
        for name_, vals in THESIS_IRIS.items():
            lines.append(f"| {name_} | " + " | ".join(f"{l:.4f} | {n}" for l, n in vals) + " |")
    votes = [r["comm"].get("vote_messages_sent", 0) for r in rows["GT"]]
    lines += ["", f"GT votes sent (all actors): {votes}; vote MB sent: "
              f"{[round(r['comm'].get('vote_bytes_sent', 0) / 1e6, 3) for r in rows['GT']]}", ""]
    if any("tests_inside" in r["comm"] or "tests_lateral" in r["comm"] for r in rows["GT"]):
        verdicts = [{k[6:]: v for k, v in sorted(r["comm"].items()) if k.startswith("tests_")} for r in rows["GT"]]
        lines += [f"GT threshold-test verdicts per seed (all actors, epochs 2 to the last; the last one is forced and sends no vote): {verdicts}", ""]
    lines += ["Front check (GT vs baselines, per seed). *Dominated*: some baseline has loss <= GT's "
              "and cost <= GT's (one strictly; the thesis's unit-square criterion, Fig. 5.1). *Front*: "
              "the lower envelope of the baselines' (cost, loss) points, interpolated linearly at GT's "
              "cost (the best baseline at or below GT's cost when GT lies beyond their range); GT is "
              "*below* it when its loss is lower.", "", "By synchronizations:", ""]
    lines += _front_lines(rows, seeds, "syncs", "synchronizations")
    lines += ["", "By bytes sent (votes included):", ""]
    lines += _front_lines(rows, seeds, "bytes_sent", "MB")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cmd_tune(a: argparse.Namespace) -> None:
    """Grid over θ_β × θ_α on the *validation* loss (test split never looked at)."""
    seeds = [int(s) for s in a.seeds.split(",")]
    over = json.loads(a.override)
    betas = [float(x) for x in a.betas.split(",")]
    alphas = [float(x) for x in a.alphas.split(",")]
    res = []
    rhos = [float(x) for x in a.rhos.split(",")] if a.rhos else [SETUPS[a.dataset]["theta_rho"]]
    for rho in rhos:
        for b in betas:
            for al in alphas:
                opts = {**json.loads(a.gt_options), "theta_rho": rho, "theta_beta": b, "theta_alpha": al}
                rs = [run_one(a.dataset, "gt", opts, s, **over) for s in seeds]
                row = {**json.loads(a.gt_options), "theta_rho": rho, "theta_beta": b, "theta_alpha": al,
                       "val_loss": float(np.mean([r["val_loss"] for r in rs])),
                       "syncs": float(np.mean([r["syncs"] for r in rs]))}
                res.append(row)
                print(row, flush=True)
    chosen = pick(res)
    print("chosen:", chosen, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = a.name or f"tune_{a.dataset}"
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "grid": res, "chosen": chosen, "rule": PICK_RULE}, indent=1) + "\n")


PICK_RULE = ("lowest mean validation loss over the tuning seeds; among configurations within 2 % of it, "
             "the one with the fewest mean synchronizations")


def pick(grid: list[dict[str, Any]]) -> dict[str, Any]:
    """The θ_β, θ_α choice (:data:`PICK_RULE`); validation loss only, never the test split."""
    best = min(r["val_loss"] for r in grid)
    near = [r for r in grid if r["val_loss"] <= best * 1.02]
    return min(near, key=lambda r: (r["syncs"], r["val_loss"]))


def cmd_lr(a: argparse.Namespace) -> None:
    """BL1 (synchronize every epoch) validation loss per learning rate (the thesis picks
    lr by a validation grid search, App. A.1)."""
    seeds = [int(s) for s in a.seeds.split(",")]
    res = []
    for lr in [float(x) for x in a.lrs.split(",")]:
        rs = [run_one(a.dataset, "local-steps", {"tau": 1}, s, **{**json.loads(a.override), "lr": lr}) for s in seeds]
        row = {"lr": lr, "val_loss": float(np.mean([r["val_loss"] for r in rs]))}
        res.append(row)
        print(row, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"lr_{a.dataset}.json").write_text(json.dumps({"command": " ".join(sys.argv), "grid": res}, indent=1) + "\n")


def main() -> int:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in ("table", "tune", "lr"):
        s = sub.add_parser(c)
        s.add_argument("--dataset", default="iris", choices=sorted(SETUPS))
        s.add_argument("--seeds", default="666,667,668,669")
        s.add_argument("--override", default="{}", help="JSON overriding the data set's setup (e.g. epochs)")
        s.add_argument("--name", default=None)
        if c in ("table", "tune"):
            s.add_argument("--gt-options", default="{}", help="JSON gt options (θ_β, θ_α, zero_median)")
        if c == "table":
            s.add_argument("--merge", default=None, help="take the baselines from results/<name>.json")
        elif c == "lr":
            s.add_argument("--lrs", default="0.05,0.1,0.2")
        else:
            s.add_argument("--betas", default="0.25,0.5,1.0")
            s.add_argument("--alphas", default="0.8,0.95,1.0")
            s.add_argument("--rhos", default=None, help="θ_ρ values (default: the data set's)")
    r = sub.add_parser("report", help="rewrite results/<name>.md from results/<name>.json")
    r.add_argument("name")
    a = p.parse_args()
    if a.cmd == "report":
        report(a.name)
        return 0
    {"table": cmd_table, "tune": cmd_tune, "lr": cmd_lr}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
