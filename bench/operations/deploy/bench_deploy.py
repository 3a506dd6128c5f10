"""Live data in, deployed models out: agents on their sample stores, runs one after the
other, windows arriving while they train.

Runs the ``dflctl demo --feed`` scenario (:func:`dfl_agent.cli.demo_feed.feed_federation`):
``--nodes`` always-on agents, one HAR user each, starting with a quarter of the user's
windows; a feeder writes the next windows into every spool while each run trains;
``--runs`` fedavg runs follow each other.  Records, per agent and run, the samples trained
on, the deployed version, its validation accuracy and its accuracy on the held-out HAR test
users, and the time from the run's end (its last round recorded) to the version being
deployed (its manifest written).  Writes ``results.json`` and ``accuracy_over_time.png``.

    nice -n 10 python bench/operations/deploy/bench_deploy.py --out bench/operations/deploy
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HARDWARE = "2-core x86_64 VM (KVM, AMD EPYC), no GPU, shared with other jobs"


def plot(summary: dict[str, Any], feed: list[dict[str, Any]], path: Path) -> bool:
    """Deployed accuracy over time per agent (validation: solid; held-out users: dashed),
    samples in each store (thin, right axis), run ends (dotted).  False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from dfl_agent.extras import extra_hint

        print(f"matplotlib is not installed ({extra_hint('plot')}): no plot drawn")
        return False
    t0 = summary["started"]
    fig, ax = plt.subplots(figsize=(9, 5))
    ax2 = ax.twinx()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    end = max([d["time"] for d in summary["deployments"]] + [e["time"] for e in feed]) - t0 + 10
    for i, (nid, node) in enumerate(summary["nodes"].items()):
        c = colours[i % len(colours)]
        deps = [d for d in summary["deployments"] if d["node"] == nid]
        for key, style, label in (("accuracy", "-", "validation"), ("heldout_accuracy", "--", "held-out users")):
            pts = [(d["time"] - t0, d[key]) for d in deps if d[key] is not None]
            if pts:
                xs = [p[0] for p in pts] + [end]
                ys = [p[1] for p in pts] + [pts[-1][1]]
                ax.step(xs, ys, where="post", linestyle=style, color=c, label=f"{nid} {label}")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=c)
        fed = [(e["time"] - t0, e["total"]) for e in feed if e["node"] == nid]
        if fed:
            ax2.step([0] + [f[0] for f in fed], [summary["feed"]["initial"][nid]] + [f[1] for f in fed],
                     where="post", color=c, alpha=0.3, linewidth=1)
        for r in node["runs"]:
            if r["run_end"]:
                ax.axvline(r["run_end"] - t0, color=c, linestyle=":", alpha=0.4)
    ax.set_xlabel("seconds since the agents started")
    ax.set_ylabel("accuracy of the deployed model")
    ax2.set_ylabel("windows given to the agent (thin lines)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{len(summary['nodes'])} agents, {len(summary['runs'])} runs of {summary['algorithm']}: "
                 "deployed model accuracy as data arrives")
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def time_deploy_step(repeat: int = 3) -> dict[str, Any]:
    """The deploy step alone, in this (fresh) process, one agent, nothing else running:
    :func:`dfl_agent.deploy.gate.deploy_model` on the small HAR model and 70 validation
    windows.  ``cold``: the first call (imports the ONNX exporter); ``warm``: later calls;
    ``no_onnx``: safetensors + spec.json only."""
    import time

    import torch

    from dfl_agent.data import load_dataset
    from dfl_agent.deploy import ModelStore
    from dfl_agent.deploy.gate import deploy_model
    from dfl_agent.models import build_model, default_spec

    torch.set_num_threads(1)
    pool = load_dataset("har").pool
    spec = default_spec(pool.input_shape, pool.num_classes, "small")
    model = build_model(spec).eval()
    x, y = pool.x[:70], pool.y[:70]
    models = ModelStore(tempfile.mkdtemp(prefix="dfl-deploy-step-"), keep=2)

    def once(**kw: Any) -> float:
        t0 = time.perf_counter()
        deploy_model(models, model, spec, pool.input_shape, pool.class_names, x, y, run_id="r", round=1,
                     algorithm="fedavg", force=True, **kw)
        return round(time.perf_counter() - t0, 3)

    cold = once()
    warm = [once() for _ in range(repeat)]
    plain = [once(onnx=False) for _ in range(repeat)]
    return {"cold_s": cold, "warm_s": warm, "no_onnx_s": plain, "median_warm_s": statistics.median(warm),
            "median_no_onnx_s": statistics.median(plain)}


def main() -> int:
    from dfl_agent.cli.demo_feed import FeedOptions, feed_federation

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4, help="agents (one HAR user each)")
    p.add_argument("--runs", type=int, default=3, help="runs one after the other")
    p.add_argument("--rounds", type=int, default=3, help="fedavg rounds per run")
    p.add_argument("--epochs", type=int, default=5, help="local epochs per round")
    p.add_argument("--max-windows", type=int, default=None, help="windows per user (default: all)")
    p.add_argument("--feed-interval", type=float, default=2.0, help="seconds between the feeder's passes")
    p.add_argument("--feed-chunk", type=int, default=16, help="windows per agent per pass")
    p.add_argument("--out", default="bench/operations/deploy", help="folder for results.json and the plot")
    p.add_argument("--step", action="store_true",
                   help="only time the deploy step alone in this process (writes deploy_step.json)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.step:
        step = {"command": "nice -n 10 python bench/operations/deploy/bench_deploy.py " + " ".join(sys.argv[1:]),
                "hardware": HARDWARE, **time_deploy_step()}
        (out / "deploy_step.json").write_text(json.dumps(step, indent=1) + "\n")
        print(json.dumps(step, indent=1))
        return 0
    work = Path(tempfile.mkdtemp(prefix="dfl-deploy-bench-"))
    summary = feed_federation(FeedOptions(nodes=a.nodes, runs=a.runs, rounds=a.rounds, epochs=a.epochs,
                                          max_windows=a.max_windows, feed_interval=a.feed_interval,
                                          feed_chunk=a.feed_chunk, out=str(work), broker="mosquitto",
                                          round_timeout=120.0, start_timeout=600.0))
    feed = [json.loads(line) for line in (work / "feed.jsonl").read_text().splitlines()]
    lat = [d["latency_s"] for d in summary["deployments"] if d["latency_s"] is not None]
    per_run = []
    for k, rid in enumerate(summary["runs"]):
        rows = [n["runs"][k] for n in summary["nodes"].values()]
        ls = [r["deploy_latency_s"] for r in rows if r["deploy_latency_s"] is not None]
        per_run.append({
            "run": k + 1, "run_id": rid, "train_samples": {n: node["runs"][k]["train_samples"]
                                                           for n, node in summary["nodes"].items()},
            "deployed": sum(r["deployed_version"] is not None for r in rows),
            "mean_validation_accuracy": statistics.fmean([r["accuracy"] for r in rows if r["accuracy"] is not None]
                                                         or [float("nan")]),
            "mean_heldout_accuracy": statistics.fmean([r["heldout_accuracy"] for r in rows
                                                       if r["heldout_accuracy"] is not None] or [float("nan")]),
            "median_deploy_latency_s": statistics.median(ls) if ls else None, "max_deploy_latency_s": max(ls or [0]),
        })
    res = {"command": "nice -n 10 python bench/operations/deploy/bench_deploy.py " + " ".join(sys.argv[1:]),
           "hardware": HARDWARE,
           "nodes": a.nodes, "runs_requested": a.runs, "rounds": a.rounds, "epochs": a.epochs,
           "feed": summary["feed"], "wall_seconds": summary["wall_seconds"], "failed": summary["failed"],
           "per_run": per_run,
           "deploy_latency_s": {"median": statistics.median(lat) if lat else None, "min": min(lat or [0]),
                                "max": max(lat or [0]), "n": len(lat)},
           "deployments": [{**d, "time": round(d["time"] - summary["started"], 2),
                            "run_end": round(d["run_end"] - summary["started"], 2) if d["run_end"] else None}
                           for d in summary["deployments"]],
           "nodes_detail": summary["nodes"]}
    (out / "results.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    plotted = plot(summary, feed, out / "accuracy_over_time.png")
    print(json.dumps({k: res[k] for k in ("per_run", "deploy_latency_s", "wall_seconds", "failed")}, indent=1,
                     default=float))
    print(f"wrote {out / 'results.json'}" + (f" and {out / 'accuracy_over_time.png'}" if plotted else ""))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
