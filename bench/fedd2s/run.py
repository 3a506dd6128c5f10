"""Benchmark of serverless FedD2S (the FedD2S paper) against FedPer, FedAvg and local training.

Scaled to a shared 2-core CPU (see results/README.md for the exact scale): 20 nodes,
participation ρ = 0.2, Dirichlet label skew α ∈ {0.1, 0.5, 1}, digits and HAR, the seed's
M1 model C(8,16,32)+F(32,16,classes) (``convdense``; the 1-D variant for HAR).  Every run
is one ``dfl_agent.runtime.node.simulator.simulate`` call; the metric is the user accuracy UA
(each node's deployed model on its own held-out 20 % split, mean over the evaluated rounds
among the last 10, then over nodes; ``summary.json["user_accuracy"]``).

Methods (all on the same rotating-token protocol except ``local_adam``):

- ``fedd2s``: Z_0 = 3/5/7 for α = 0.1/0.5/1 (seed), dropping set [C3, F1, F2, F3], Adam 0.01;
- ``fedper``: base shared FedAvg-style, classifier (F3) personal, 1 local epoch, Adam 0.01;
- ``fedavg``: ``fedper`` with ``head_layers = 0`` = FedAvg at ρ = 0.2 with Adam 0.01; its
  deployed model is the global model, so UA = the global model on each node's split;
- ``local``: ``local_adam``, every node trains 1 epoch per round alone (Adam 0.01);
- ``local_rho``: ``local_adam`` training only in the rounds the node would be drawn
  (ρ = 0.2, same draw as fedd2s): local training at the federated methods' compute.

Parts (``--part``): ``main`` (the UA table), ``main-e4`` (the same with the seed's E = 4
passes per phase for fedd2s and 4 local epochs per participation for fedper, fedavg and
local_rho; ``local`` keeps 1 epoch every round; seeds 0-2), ``z0`` (Z_0 sensitivity, seed Fig. 7, digits
only), ``reference`` (the centralized server at benchmark scale), ``epochs`` (4 passes per phase, the seed's E = 4, fedd2s vs fedper, α = 0.1), or ``all``.  Results append to ``runs.jsonl`` (a finished run is skipped when
re-run), then ``report.py`` writes ``results.md`` and the plots.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python bench/fedd2s/run.py --part main
    nice -n 10 .venv/bin/python bench/fedd2s/run.py --part main-e4 --alphas 0.1 --rounds 100   # longer horizon
    nice -n 10 .venv/bin/python bench/fedd2s/run.py --part z0
    nice -n 10 .venv/bin/python bench/fedd2s/run.py --part epochs
    nice -n 10 .venv/bin/python bench/fedd2s/run.py --part epochs-seed1
    .venv/bin/python bench/fedd2s/report.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dfl_agent.cli.progress import simulate_with_progress as simulate  # noqa: E402  (progress on stderr)
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.runtime.node.simulator import SimConfig  # noqa: E402

OUT = ROOT / "bench" / "fedd2s" / "results"
Z0 = {0.1: 3, 0.5: 5, 1.0: 7}
SCALE = {  # rounds, seeds per data set (CPU budget)
    "digits": {"rounds": 60, "seeds": (0, 1)},
    "har": {"rounds": 30, "seeds": (0, 1)},
}
METHODS = {
    "fedd2s": ("fedd2s", {}),
    "fedper": ("fedper", {"head_layers": 1}),
    "fedavg": ("fedper", {"head_layers": 0}),
    "local": ("local_adam", {}),
    "local_rho": ("local_adam", {"participation": 0.2}),
}


def spec_for(dataset: str) -> dict[str, Any]:
    shape, classes = ([1, 8, 8], 10) if dataset == "digits" else ([3, 128], 6)
    return {"type": "convdense", "input_shape": shape, "conv": [8, 16, 32], "dense": [32, 16], "num_classes": classes}


def options_for(method: str, alpha: float, z0: int | None = None, epochs: int = 1) -> dict[str, Any]:
    algo, opts = METHODS[method]
    opts = dict(opts)
    if algo == "fedd2s":
        opts["z0"] = z0 if z0 is not None else Z0[alpha]
        # explicit: the algorithm's default is E = 4 now; the committed E = 1 runs predate it
        # and carry no epochs key (report.py reads a missing key as 1)
        opts.update(c2s_epochs=epochs, s2c_epochs=epochs)
    elif epochs != 1:
        opts["local_epochs"] = epochs
    return opts


def run_one(dataset: str, alpha: float, seed: int, method: str, rounds: int, z0: int | None = None,
            eval_every: int = 5, epochs: int = 1, nodes: int = 20) -> dict[str, Any]:
    algo = METHODS[method][0]
    opts = options_for(method, alpha, z0, epochs)
    cfg = SimConfig(algorithm=algo, nodes=nodes, rounds=rounds, dataset=dataset, partition="dirichlet", beta=alpha,
                    seed=seed, model_spec=spec_for(dataset), train=TrainConfig(batch_size=32), options=opts,
                    eval_every=eval_every, threads=1)
    t0 = time.time()
    s = simulate(cfg)
    ua = s["user_accuracy"]
    return {
        "dataset": dataset, "alpha": alpha, "seed": seed, "method": method, "algorithm": algo, "options": opts,
        "nodes": nodes, "rounds": rounds, "eval_every": eval_every, "ua": ua["mean"], "ua_std_nodes": ua["std"],
        "ua_per_node": ua["per_node"], "histogram": ua["histogram"],
        "global_accuracy": s["global_accuracy"]["mean"], "bytes_sent": s["bytes_sent"],
        "bytes_per_round": s["bytes_sent"] / rounds, "curve_round": s["curve"]["round"],
        "curve_local": s["curve"].get("local_accuracy"), "wall": time.time() - t0,
    }


def reference(out: Path) -> None:
    """The centralized reference (server fed the features) at benchmark scale: digits, α = 0.1,
    seed 0 — its UA must equal the serverless run's; also the bytes the server receives."""
    from bench.fedd2s.reference import simulate_reference

    cfg = SimConfig(algorithm="fedd2s", nodes=20, rounds=SCALE["digits"]["rounds"], dataset="digits",
                    partition="dirichlet", beta=0.1, seed=0, model_spec=spec_for("digits"),
                    train=TrainConfig(batch_size=32), options=options_for("fedd2s", 0.1), eval_every=5, threads=1)
    s = simulate_reference(cfg)
    s["server_bytes_received_per_round"] = s["server_bytes_received"] / cfg.rounds
    (out / "reference.json").write_text(json.dumps(s, indent=2) + "\n")
    print(f"reference: UA={s['user_accuracy']['mean']:.4f} server rx/round={s['server_bytes_received_per_round']:.0f}")


def key(r: dict[str, Any]) -> tuple:
    """A run's identity (records written before ``--nodes`` existed ran 20 nodes)."""
    return (r["dataset"], r["alpha"], r["seed"], r["method"], r["rounds"], json.dumps(r["options"], sort_keys=True),
            r.get("nodes", 20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("main", "main-e4", "z0", "epochs", "epochs-seed1", "reference", "all"),
                    default="main")
    ap.add_argument("--seeds", default="0,1,2", help="main-e4 and z0: comma-separated seeds")
    ap.add_argument("--datasets", default="digits,har")
    ap.add_argument("--alphas", default="0.1,0.5,1", help="main-e4: comma-separated Dirichlet α")
    ap.add_argument("--rounds", type=int, default=0, help="main-e4: rounds (0: the data set's SCALE)")
    ap.add_argument("--nodes", type=int, default=20, help="main-e4: number of nodes (the seed runs 50)")
    ap.add_argument("--methods", default=",".join(METHODS), help="main-e4: comma-separated methods")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    done = set()
    if path.exists():
        done = {key(json.loads(line)) for line in path.read_text().splitlines() if line.strip()}
    plan: list[tuple] = []
    if a.part in ("main", "all"):
        for ds in a.datasets.split(","):
            sc = SCALE[ds]
            for seed in sc["seeds"]:
                for alpha in (0.1, 0.5, 1.0):
                    for m in METHODS:
                        plan.append((ds, alpha, seed, m, sc["rounds"], None, 1, 20))
    if a.part in ("main-e4", "all"):  # the seed's Table 2 setting: E = 4 passes per phase / local epochs, 3 seeds
        for ds in a.datasets.split(","):
            for seed in (int(x) for x in a.seeds.split(",")):
                for alpha in (float(x) for x in a.alphas.split(",")):
                    for m in a.methods.split(","):
                        plan.append((ds, alpha, seed, m, a.rounds or SCALE[ds]["rounds"], None,
                                     1 if m == "local" else 4, a.nodes))
    if a.part in ("z0", "all"):
        for seed in (int(x) for x in a.seeds.split(",")):
            for alpha in (0.1, 1.0):
                for z0 in (1, 3, 7, 100):
                    plan.append(("digits", alpha, seed, "fedd2s", SCALE["digits"]["rounds"], z0, 1, 20))
    if a.part in ("epochs", "all"):  # the seed's E = 4 passes per phase / local epochs (fedd2s vs fedper)
        for ds in ("digits", "har"):
            for m in ("fedd2s", "fedper"):
                plan.append((ds, 0.1, 0, m, SCALE[ds]["rounds"], None, 4, 20))
    if a.part in ("epochs-seed1", "all"):  # a second seed for the E = 4 comparison on HAR, α = 0.1
        for m, ep in (("fedd2s", 4), ("fedper", 4), ("local", 1)):
            plan.append(("har", 0.1, 1, m, SCALE["har"]["rounds"], None, ep, 20))
    if a.part in ("reference", "all"):
        reference(out)
    for ds, alpha, seed, m, rounds, z0, ep, nodes in plan:
        k = (ds, alpha, seed, m, rounds, json.dumps(options_for(m, alpha, z0, ep), sort_keys=True), nodes)
        if k in done:
            continue
        r = run_one(ds, alpha, seed, m, rounds, z0, epochs=ep, nodes=nodes)
        done.add(key(r))
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{ds} n={nodes} a={alpha} s={seed} {m:7s} z0={z0} UA={r['ua']:.3f} ±{r['ua_std_nodes']:.3f} "
              f"B/round={r['bytes_per_round']:.0f} {r['wall']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
