"""Compression benchmark: accuracy against bytes on the wire.

Grid: digits (Dirichlet β=0.5) and HAR (by user), both non-IID; ``fedavg`` and
``dechw`` (averaging gossip: CHOCO-compressed differences) and ``dfml`` (whole-model
exchanges: value coders only, a sparsifier does not apply) with float32 (``none``),
``fp16``, ``q8``, ``q4``, ``topk:0.01+q8`` and ``topk:0.1+q8``, the last two with and
without error feedback.  Scaled to a shared 2-core CPU (see README.md here).

Usage (from the repository root):
    nice -n 10 .venv/bin/python bench/compression/run.py             # grid, then report
    .venv/bin/python bench/compression/run.py --report               # report only
    nice -n 10 .venv/bin/python bench/compression/run.py --only digits

Each run is saved to results/runs/<name>.json when it finishes (reruns skip it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs"
SEEDS = (0,)
DATASETS = {
    "digits": dict(dataset="digits", nodes=6, rounds=20, partition="dirichlet", beta=0.5),
    "har": dict(dataset="har", nodes=6, rounds=10, partition="by-user"),
}
GOSSIP_SPECS = [("none", True), ("fp16", True), ("q8", True), ("q4", True),
                ("topk:0.01+q8", True), ("topk:0.01+q8", False), ("topk:0.1+q8", True), ("topk:0.1+q8", False)]
MODEL_SPECS = [("none", True), ("fp16", True), ("q8", True), ("q4", True)]
ALGS = {"fedavg": GOSSIP_SPECS, "dechw": GOSSIP_SPECS, "dfml": MODEL_SPECS}


def tag(spec: str, ef: bool) -> str:
    return spec.replace(":", "").replace("+", "_").replace(".", "") + ("" if ef else "-noEF")


LONG = dict(DATASETS["digits"], rounds=100, algorithm="fedavg", seed=0)
LONG_SPECS = [("none", True, 0.0), ("q8", True, 0.0), ("topk:0.01+q8", True, 0.0), ("topk:0.01+q8", False, 0.0),
              ("topk:0.1+q8", True, 0.0), ("topk:0.1+q8", False, 0.0), ("topk:0.1+q8", True, 1.0)]


def grid(only: str | None = None, seeds=SEEDS, algs=None, specs=None) -> list[tuple[str, dict]]:
    if only == "long":  # longer horizon for the sparsified streams (digits, fedavg, 100 rounds)
        return [(f"long-digits-fedavg-{tag(spec, ef)}{'-g%g' % g if g else ''}-s0",
                 dict(LONG, compression=spec, error_feedback=ef, consensus_step=g)) for spec, ef, g in LONG_SPECS]
    g = []
    for ds, base in DATASETS.items():
        if only and ds != only:
            continue
        for alg, alg_specs in ALGS.items():
            if algs and alg not in algs:
                continue
            for spec, ef in alg_specs:
                if specs and spec not in specs:
                    continue
                for seed in seeds:
                    g.append((f"{ds}-{alg}-{tag(spec, ef)}-s{seed}",
                              dict(base, algorithm=alg, compression=spec, error_feedback=ef, seed=seed)))
    return g


def run_all(only: str | None, **filters) -> None:
    from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
    from dfl_agent.runtime.node.simulator import SimConfig

    RUNS.mkdir(parents=True, exist_ok=True)
    for name, kw in grid(only, **filters):
        path = RUNS / f"{name}.json"
        if path.exists():
            continue
        t0 = time.time()
        s = simulate(SimConfig(threads=1, eval_every=2 if kw["rounds"] <= 20 else 10, **kw))
        keep = {k: s[k] for k in ("global_accuracy", "bytes_sent", "compression_ratio", "bytes_sent_by_kind",
                                  "float32_bytes_sent", "curve", "rounds_completed", "dropped")}
        keep["global_accuracy"] = {k: v for k, v in keep["global_accuracy"].items() if k != "per_node"}
        keep.update(config=kw, wall_seconds=time.time() - t0)
        path.write_text(json.dumps(keep, indent=1) + "\n")
        print(f"{name}: acc {s['global_accuracy']['mean']:.4f} bytes {s['bytes_sent']} "
              f"({time.time() - t0:.0f}s)", flush=True)


def plot_curves(series: list[tuple[str, dict]], title: str, path: Path) -> None:
    """Accuracy against cumulative MB sent (log x), one line per ``(label, curve)``;
    ``curve`` holds the simulator's ``bytes_sent`` and ``global_accuracy`` lists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in series:
        ax.plot([b / 1e6 for b in c["bytes_sent"]], c["global_accuracy"], marker=".", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative MB sent (all nodes)")
    ax.set_ylabel("mean global accuracy")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report() -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))}
    lines = ["# Compression benchmark results", "",
             "Accuracy = mean global test accuracy over nodes after the last round; bytes = all",
             "bytes all nodes put on the wire (envelopes included); ratio and Δ against float32",
             "(`none`) of the same dataset, algorithm and seed at equal rounds.", ""]
    for ds in DATASETS:
        for alg in ALGS:
            base = runs.get(f"{ds}-{alg}-none-s0")
            rows = [(n, r) for n, r in runs.items() if n.startswith(f"{ds}-{alg}-")]
            if not rows or base is None:
                continue
            lines += [f"## {ds} / {alg}", "",
                      "| spec | error feedback | seed | accuracy | Δ acc (pt) | MB sent | × fewer bytes | wall s |",
                      "|---|---|---|---|---|---|---|---|"]
            series = []
            for n, r in rows:
                cfg = r["config"]
                b = runs.get(f"{ds}-{alg}-none-s{cfg['seed']}")
                if b is None:
                    continue
                acc = r["global_accuracy"]["mean"]
                ratio = b["bytes_sent"] / r["bytes_sent"]
                sparse = "topk" in cfg["compression"]
                lines.append(
                    f"| `{cfg['compression']}` | {('on' if cfg['error_feedback'] else 'off') if sparse else '—'} | "
                    f"{cfg['seed']} | {acc:.4f} | {100 * (acc - b['global_accuracy']['mean']):+.2f} | "
                    f"{r['bytes_sent'] / 1e6:.3f} | {ratio:.2f} | {r['wall_seconds']:.0f} |")
                if cfg["seed"] != 0:
                    continue
                series.append((cfg["compression"] + ("" if cfg["error_feedback"] or not sparse else " no EF"),
                               r["curve"]))
            plot_curves(series, f"{alg} on {ds}", HERE / "results" / f"{ds}-{alg}.png")
            lines += ["", f"![{ds} {alg}]({ds}-{alg}.png)", ""]
    lines += _long_section(runs)
    (HERE / "results" / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _long_section(runs: dict) -> list[str]:
    rows = [(n, r) for n, r in runs.items() if n.startswith("long-")]
    base = runs.get("long-digits-fedavg-none-s0")
    if not rows or base is None:
        return []
    lines = ["## Longer horizon: digits / fedavg, 100 rounds", "",
             "| spec | error feedback | γ | accuracy | Δ acc (pt) | MB sent | × fewer bytes |", "|---|---|---|---|---|---|---|"]
    series = []
    for n, r in rows:
        cfg = r["config"]
        acc = r["global_accuracy"]["mean"]
        sparse = "topk" in cfg["compression"]
        lines.append(
            f"| `{cfg['compression']}` | {('on' if cfg['error_feedback'] else 'off') if sparse else '—'} | "
            f"{cfg.get('consensus_step') or 'auto'} | {acc:.4f} | {100 * (acc - base['global_accuracy']['mean']):+.2f} | "
            f"{r['bytes_sent'] / 1e6:.3f} | {base['bytes_sent'] / r['bytes_sent']:.2f} |")
        label = cfg["compression"] + ("" if cfg["error_feedback"] or not sparse else " no EF") + (
            f" γ={cfg['consensus_step']}" if cfg.get("consensus_step") else "")
        series.append((label, r["curve"]))
    plot_curves(series, "fedavg on digits, 100 rounds", HERE / "results" / "long-digits-fedavg.png")
    return lines + ["", "![long](long-digits-fedavg.png)", ""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true", help="only rebuild results/report.md and the plots")
    ap.add_argument("--only", choices=list(DATASETS) + ["long"], help="run one dataset's grid, or the long-horizon runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (default: 0)")
    ap.add_argument("--algs", nargs="+", default=None, help="only these algorithms")
    ap.add_argument("--specs", nargs="+", default=None, help="only these specs")
    a = ap.parse_args(argv)
    if not a.report:
        run_all(a.only, seeds=tuple(a.seeds), algs=a.algs, specs=a.specs)
    report()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    main()
