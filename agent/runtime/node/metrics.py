"""Run reports: per-round metrics (JSON lines), ``summary.json`` and an accuracy plot.

``summary.json`` contract (later issues and benchmarks rely on it)::

    {"algorithm": str, "nodes": int, "rounds_completed": int,
     "global_accuracy": {"mean": f, "std": f, "per_node": {node: f}},   # fractions 0..1
     "local_accuracy":  {"mean": f, "std": f, "per_node": {node: f}},
     "bytes_sent": int, "bytes_received": int, "wall_seconds": f,
     # when a local-only baseline ran (the demo):
     "local_only_global_accuracy": {"mean": f, "std": f, "per_node": {node: f}}, ...}

Accuracies are those of each node's last completed round.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.extras import extra_hint
from dfl_agent.jsonbound import loads as bounded_loads


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`dfl_agent.fsutil.atomic_write`)."""
    from dfl_agent.fsutil import atomic_write

    atomic_write(path, text)


def _stats(per_node: Mapping[str, float]) -> dict[str, Any]:
    vals = [v for v in per_node.values() if v is not None and not math.isnan(v)]
    mean = sum(vals) / len(vals) if vals else float("nan")
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if vals else float("nan")
    return {"mean": mean, "std": std, "per_node": dict(per_node)}


def summarize(
    algorithm: str,
    histories: Mapping[str, list[dict[str, Any]]],
    *,
    wall_seconds: float,
    bytes_by_node: Mapping[str, tuple[int, int]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the ``summary.json`` document from per-node round records.

    Args:
        histories: node id -> list of metrics records (as produced by ``Node``).
        bytes_by_node: node id -> (sent, received); default: from the last records.
    """
    last = {n: h[-1] for n, h in histories.items() if h}
    scored = {n: [r for r in h if "global_accuracy" in r][-1] for n, h in histories.items()
              if any("global_accuracy" in r for r in h)}
    out: dict[str, Any] = {
        "algorithm": algorithm,
        "nodes": len(histories),
        "rounds_completed": max((r["round"] for r in last.values()), default=0),
        "rounds_per_node": {n: last[n]["round"] if n in last else 0 for n in histories},
        "global_accuracy": _stats({n: r["global_accuracy"] for n, r in scored.items()}),
        "local_accuracy": _stats({n: r["local_accuracy"] for n, r in scored.items()}),
    }
    for key in ("local_only_global_accuracy", "local_only_local_accuracy", "regular_global_accuracy"):
        if any(key in r for r in scored.values()):
            out[key] = _stats({n: r[key] for n, r in scored.items() if key in r})
    if bytes_by_node is None:
        bytes_by_node = {n: (r["bytes_sent"], r["bytes_received"]) for n, r in last.items()}
    out["bytes_sent"] = int(sum(s for s, _ in bytes_by_node.values()))
    out["bytes_received"] = int(sum(r for _, r in bytes_by_node.values()))
    out["bytes_per_node"] = {n: {"sent": s, "received": r} for n, (s, r) in bytes_by_node.items()}
    out["wall_seconds"] = wall_seconds
    if extra:
        out.update(extra)
    return out


CURVE_KEYS = ("global_accuracy", "local_accuracy", "regular_global_accuracy", "local_only_global_accuracy")


def _by_round(histories: Mapping[str, list[dict[str, Any]]], key: str) -> dict[int, list[Any]]:
    """Round -> the values of ``key`` in the records of that round that have it (every node)."""
    by_round: dict[int, list[Any]] = {}
    for h in histories.values():
        for r in h:
            if key in r:
                by_round.setdefault(r["round"], []).append(r[key])
    return by_round


def mean_curve(histories: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per round (evaluated rounds only): the mean over nodes of each accuracy key and
    the cumulative bytes sent by all nodes. ``{"round": [...], key: [...], "bytes_sent": [...]}``."""
    rounds = sorted({r["round"] for h in histories.values() for r in h if "global_accuracy" in r})
    out: dict[str, list[float]] = {"round": [float(x) for x in rounds]}
    for key in CURVE_KEYS:
        by_round = _by_round(histories, key)
        vals = [by_round.get(x, []) for x in rounds]
        if any(vals):
            out[key] = [sum(v) / len(v) if v else float("nan") for v in vals]
    # bytes: each node's counter is cumulative; sum the latest value of every node up to the round
    out["bytes_sent"] = [float(sum(next((r["bytes_sent"] for r in reversed(h) if r["round"] <= x), 0)
                                   for h in histories.values())) for x in rounds]
    return out


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Write records as JSON lines (atomically)."""
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read JSON lines, skipping blank or truncated lines."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(bounded_loads(line.strip(), max_bytes=64 << 20))
        except ValueError:  # JSONBoundError included: a blank, torn or hostile line is skipped
            continue
    return out


def _plot_means(ax, histories: Mapping[str, list[dict[str, Any]]]) -> None:
    """Bold black lines: mean over nodes per round, federated (solid) and alone (dashed)."""
    for key, style, label in (("global_accuracy", "-", "mean"), ("local_only_global_accuracy", "--", "mean, alone")):
        if by_round := _by_round(histories, key):
            xs = sorted(by_round)
            ax.plot(xs, [sum(by_round[x]) / len(by_round[x]) for x in xs], color="black", linestyle=style,
                    linewidth=2.5, label=label)


#: the one line printed (to stderr) when a plot is skipped for want of matplotlib
PLOT_HINT = f"no accuracy plot: matplotlib is not installed ({extra_hint('plot')})"


def plot_accuracy(histories: Mapping[str, list[dict[str, Any]]], path: str | os.PathLike, title: str = "") -> bool:
    """PNG plot of global test accuracy per round for each node (solid) and, when
    present, of the local-only baseline (dashed).

    Algorithms with a second evaluated model and rotating rounds (DFML) are labelled so that
    the curves explain themselves: the solid line is the deployed (peak) model, which changes
    only when α reaches a new maximum (flat in between); the regular model trained every round
    (``regular_global_accuracy``) is dotted; a dot marks each round the node took part in
    (``participated``).

    matplotlib is optional (the ``plot`` extra): without it nothing is written, :data:`PLOT_HINT`
    is printed once to stderr and False returned. Returns True when the plot was written."""
    try:
        import matplotlib
    except ImportError:
        import sys

        print(PLOT_HINT, file=sys.stderr)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (node, hist) in enumerate(sorted(histories.items())):
        if not hist:
            continue
        c = colors[i % len(colors)]
        hist = [r for r in hist if "global_accuracy" in r]
        rounds = [r["round"] for r in hist]
        ax.plot(rounds, [r["global_accuracy"] for r in hist], color=c, label=f"{node}")
        if hist and "local_only_global_accuracy" in hist[0]:
            ax.plot(rounds, [r["local_only_global_accuracy"] for r in hist], color=c, linestyle="--", alpha=0.6)
        regular = [r for r in hist if isinstance(r.get("regular_global_accuracy"), (int, float))]
        if regular:
            ax.plot([r["round"] for r in regular], [r["regular_global_accuracy"] for r in regular], color=c,
                    linestyle=":", alpha=0.7)
        took_part = [r for r in hist if r.get("participated") is True]
        if took_part:
            ax.plot([r["round"] for r in took_part], [r["global_accuracy"] for r in took_part], color=c,
                    linestyle="none", marker="o", markersize=3)
    _plot_means(ax, histories)
    evaluated = [r for h in histories.values() for r in h]
    if any("regular_global_accuracy" in r for r in evaluated):
        note = "solid: deployed (peak) model, changes only at a new α maximum; dotted: regular model"
        if any("participated" in r for r in evaluated):
            note += "; dot: node took part in that round"
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7, va="bottom", alpha=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("global test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title or "accuracy per round (dashed: same model trained alone)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def user_accuracy(histories: Mapping[str, list[dict[str, Any]]], last: int = 10,
                  key: str = "local_accuracy") -> dict[str, Any]:
    """User-model accuracy UA (FedD2S seed 002 §IV-A): each node's deployable (personal)
    model on its own held-out split (``local_accuracy``), averaged per node over the
    evaluated rounds among the last ``last`` rounds, then over nodes.

    Returns ``{"mean", "std" (over nodes), "per_node", "last_rounds", "histogram"}``;
    ``histogram`` counts nodes per accuracy decile ``[0, .1), …, [.9, 1]`` (fairness, Fig. 4).
    """
    final = max((r["round"] for h in histories.values() for r in h), default=0)
    per_node: dict[str, float] = {}
    for n, h in histories.items():
        vals = [r[key] for r in h if key in r and r["round"] > final - last and r[key] is not None
                and not math.isnan(r[key])]
        per_node[n] = sum(vals) / len(vals) if vals else float("nan")
    out = _stats(per_node)
    hist = [0] * 10
    for v in per_node.values():
        if not math.isnan(v):
            hist[min(9, int(v * 10))] += 1
    out.update({"last_rounds": last, "histogram": hist})
    return out


def written_rounds(path: Path | None, node_id: str, run_id: str | None, since: int,
                   tail_bytes: int = 4 << 20) -> set[int]:
    """Rounds ``>= since`` that ``node_id`` (in run ``run_id``, None = outside runs) has a
    record of in the metrics file ``path``.  Reads the last ``tail_bytes`` only: the
    records a resume looks for are among the newest.  Torn or foreign lines are skipped."""
    out: set[int] = set()
    if path is None or not path.exists():
        return out
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - tail_bytes))
        lines = f.read().splitlines()
    if size > tail_bytes:
        lines = lines[1:]  # the first one may be cut
    for line in lines:
        try:  # depth-bounded: a forged line must not raise RecursionError here
            rec = bounded_loads(line, max_bytes=tail_bytes)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("node") == node_id and rec.get("run") == run_id \
                and isinstance(rec.get("round"), int) and rec["round"] >= since:
            out.add(rec["round"])
    return out


def end_torn_line(path: Path) -> None:
    """End the metrics file with a newline when a kill cut its last record short, so that
    the next record starts on a line of its own."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        pass
