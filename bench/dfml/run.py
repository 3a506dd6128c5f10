"""DFML benchmark: the shape of the DFML paper's Tables 3/6 (DFML vs cluster-wise FedAvg),
Table 8 (rounds to reach FedAvg's final accuracy) and Table 9 (CE/WSM x fixed/cyclic α),
at a scale that fits a 2-core CPU shared with other jobs, with a learning rate
chosen per method on validation data (the DFML paper's App. A.2: "the learning rate is selected
from {0.1, 0.01, 0.001}").

Stages (run from the repository root; each run is saved as results/runs/<name>.json as
soon as it finishes and a rerun skips runs already there):

    nice -n 10 .venv/bin/python bench/dfml/run.py select     # seed 0 at every lr in LRS
    .venv/bin/python bench/dfml/select_lr.py                  # choose lr on validation
    nice -n 10 .venv/bin/python bench/dfml/run.py grid       # seeds 1, 2 at the chosen lr
    nice -n 10 .venv/bin/python bench/dfml/run.py ablation   # Table 9 + α-schedule options
    # horizon check (three α cycles instead of two):
    nice -n 10 .venv/bin/python bench/dfml/run.py ablation --setting har-noniid-H2 --rounds 63 --variants abl_wsm_fixed,dfedavg,top2
    nice -n 10 .venv/bin/python bench/dfml/run.py resnet     # H1-resnet, small scale, untuned lr
    .venv/bin/python bench/dfml/run.py report                 # report.md and curves.png

``--only SUBSTRING`` restricts a stage to the runs whose name contains it (used to
split the work over two processes).  Run names: ``<setting>-<method>[_variant]-lr<lr>-s<seed>``.

Learning-rate protocol (select_lr.py): for every setting (data set, partition, model
family) and method, seed 0 runs at each lr in {0.1, 0.01, 0.001}; the lr with the
highest *validation* accuracy (mean over nodes of the deployable model's accuracy on the
node's own held-out 20 % split of its local data, ``local_accuracy``, last round) is
chosen.  The test split is never read by the selection.  Seed 0's run at the chosen lr
is then reused as the first of the three seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs"
LRS = (0.1, 0.01, 0.001)
SEEDS = (0, 1, 2)
ROUNDS = 32  # end of the second α cycle (rounds 1-11, 12-32); the first grid used 63
DIGITS = dict(dataset="digits", nodes=20, rounds=ROUNDS)
HAR = dict(dataset="har", nodes=10, rounds=ROUNDS, partition="by-user")
PARTS = {"iid": dict(partition="iid"), "noniid": dict(partition="dirichlet", beta=0.1)}
METHODS = {
    "H0": ("dfml", "dfedavg", "dfedprox", "local"),
    "H2": ("dfml", "dfedavg", "local"),
    "H1": ("dfml", "dfedavg", "heterofl", "fedrolex"),
    "H1-resnet": ("dfml", "dfedavg", "heterofl", "fedrolex"),
}
# Table 9 ablation and α-schedule options (DFML, digits non-IID, H2, DFML's chosen lr)
ABLATION = {
    "abl_ce_fixed": {"supervision": "ce", "alpha_mode": "fixed"},
    "abl_ce_cyclic": {"supervision": "ce"},
    "abl_wsm_fixed": {"alpha_mode": "fixed"},
    "abl_wsm_fixed0.9": {"alpha_mode": "fixed", "alpha_fixed": 0.9},  # fixed at cyclic α's maximum
    "abl_wsm_fixed0.2": {"alpha_mode": "fixed", "alpha_fixed": 0.2},
    "amax1.0": {"alpha_max": 1.0},
    "amax0.8": {"alpha_max": 0.8},
    "shape_full": {"alpha_shape": "full"},
    "period_mult": {"period_growth": "multiplicative"},
    "top2": {"peak_top_k": 2},  # the paper's appendix rule N/|S| at 50 % senders
    "full": {"sender_ratio": 1.0},  # every live peer sends: no node misses the α maximum
    "full_fixed": {"sender_ratio": 1.0, "alpha_mode": "fixed"},
}


def settings() -> dict[str, dict]:
    """Setting name -> simulator keywords (data, partition, model family)."""
    out = {}
    for part, pk in PARTS.items():
        for fam in ("H0", "H2", "H1", "H1-resnet"):
            out[f"digits-{part}-{fam}"] = dict(DIGITS, **pk, model_family=fam)
    out["har-byuser-H2"] = dict(HAR, model_family="H2")
    # label skew with ~370 training windows per node (digits has ~57): the paper's kind of non-IID at a data
    # size where distillation between peers has something to carry
    out["har-noniid-H2"] = dict(HAR, nodes=20, partition="dirichlet", beta=0.1, model_family="H2")
    return out


def run_name(setting: str, method: str, lr: float, seed: int, variant: str = "") -> str:
    return f"{setting}-{method}{'_' + variant if variant else ''}-lr{lr:g}-s{seed}"


def family_of(setting: str) -> str:
    return setting.split("-", 2)[2]


def selection_runs() -> list[tuple[str, dict]]:
    g = []
    for setting, kw in settings().items():
        for method in METHODS[family_of(setting)] if not setting.startswith("har") else ("dfml", "dfedavg", "local"):
            for lr in LRS:
                g.append((run_name(setting, method, lr, 0), dict(kw, algorithm=method, seed=0, lr=lr)))
    return g


def _chosen() -> dict[str, float]:
    path = HERE / "results" / "lr_selection.json"
    if not path.exists():
        raise SystemExit("run `bench/dfml/select_lr.py` first (results/lr_selection.json is missing)")
    return {k: v["lr"] for k, v in json.loads(path.read_text())["chosen"].items()}


def grid_runs(seeds=SEEDS[1:]) -> list[tuple[str, dict]]:
    chosen, sets, g = _chosen(), settings(), []
    for key, lr in chosen.items():
        setting, method = key.rsplit("/", 1)
        for seed in seeds:
            g.append((run_name(setting, method, lr, seed), dict(sets[setting], algorithm=method, seed=seed, lr=lr)))
    return g


def ablation_runs(seeds=SEEDS, variants=tuple(ABLATION), setting: str = "digits-noniid-H2",
                  lr: float | None = None, rounds: int | None = None) -> list[tuple[str, dict]]:
    """The ablation's runs at DFML's chosen lr, or at ``lr`` (a sensitivity check; the
    default variant, WSM with cyclic α, then runs at that lr too), or over ``rounds``
    rounds instead of ROUNDS (a horizon check, at the chosen lr; run names then carry the
    setting as ``<setting>-r<rounds>`` and the default variant runs too; ``variants`` may
    name ``dfedavg`` to run the cluster-wise baseline at its own chosen lr as well)."""
    table = dict(ABLATION) if lr is None and rounds is None else {"": {}, **ABLATION}
    kw = settings()[setting]
    out = []
    if rounds is not None:
        kw = dict(kw, rounds=rounds)
        if "dfedavg" in variants:
            base_lr = _chosen()[f"{setting}/dfedavg"]
            out += [(run_name(f"{setting}-r{rounds}", "dfedavg", base_lr, seed),
                     dict(kw, algorithm="dfedavg", seed=seed, lr=base_lr)) for seed in seeds]
    name = setting if rounds is None else f"{setting}-r{rounds}"
    lr = _chosen()[f"{setting}/dfml"] if lr is None else lr
    return out + [(run_name(name, "dfml", lr, seed, variant), dict(kw, algorithm="dfml", seed=seed, lr=lr, options=opts))
                  for seed in seeds for variant, opts in table.items() if variant in variants or not variant]


# H1-resnet at a smaller scale (the ResNet18 at full width is ~2.8 M parameters): 10 nodes, 11 rounds (end of
# the first α cycle), seed 0, one untuned lr for every method (no selection: CPU budget)
RESNET_SMALL = dict(dataset="digits", nodes=10, rounds=11, partition="dirichlet", beta=0.1, model_family="H1-resnet")
RESNET_LR = 0.01


def resnet_runs() -> list[tuple[str, dict]]:
    return [(run_name("digits-noniid-H1-resnet-small", m, RESNET_LR, 0), dict(RESNET_SMALL, algorithm=m, seed=0,
                                                                             lr=RESNET_LR))
            for m in ("dfml", "heterofl", "fedrolex", "dfedavg")]


def run_all(runs: list[tuple[str, dict]], only: str | None) -> None:
    from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig

    RUNS.mkdir(parents=True, exist_ok=True)
    for name, kw in runs:
        path = RUNS / f"{name}.json"
        if path.exists() or (only and only not in name):
            continue
        kw = dict(kw)
        lr = kw.pop("lr")
        t0 = time.time()
        cfg = SimConfig(train=TrainConfig(batch_size=64, lr=lr), eval_every=1, threads=1, **kw)
        summary = simulate(cfg)
        summary.pop("config", None)
        path.write_text(json.dumps({"name": name, "config": dict(kw, lr=lr), "summary": summary}, default=str))
        print(f"{name}: test {summary['global_accuracy']['mean']:.3f} val {summary['local_accuracy']['mean']:.3f}"
              f" in {time.time() - t0:.0f}s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=("select", "grid", "ablation", "resnet", "report"))
    p.add_argument("--only", help="only runs whose name contains this substring")
    p.add_argument("--seeds", help="comma-separated seeds (grid: default 1,2; ablation: default 0,1,2)")
    p.add_argument("--variants", help="comma-separated ablation variants (default: all of ABLATION)")
    p.add_argument("--setting", default="digits-noniid-H2", help="ablation: the setting (default digits-noniid-H2)")
    p.add_argument("--lr", type=float, help="ablation: this lr instead of DFML's chosen one (sensitivity)")
    p.add_argument("--rounds", type=int, help=f"ablation: this many rounds instead of {ROUNDS} (horizon check)")
    a = p.parse_args()
    seeds = tuple(int(x) for x in a.seeds.split(",")) if a.seeds else None
    if a.stage == "select":
        run_all(selection_runs(), a.only)
    elif a.stage == "grid":
        run_all(grid_runs(seeds or SEEDS[1:]), a.only)
    elif a.stage == "resnet":
        run_all(resnet_runs(), a.only)
    elif a.stage == "ablation":
        run_all(ablation_runs(seeds or SEEDS, tuple(a.variants.split(",")) if a.variants else tuple(ABLATION),
                              a.setting, a.lr, a.rounds),
                a.only)
    else:
        from bench.dfml.report import write_report

        write_report(RUNS, HERE / "results")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    import torch

    torch.set_num_threads(1)
    sys.exit(main())
