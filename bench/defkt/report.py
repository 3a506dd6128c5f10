"""Tables and plots of the Def-KT benchmark from ``<out>/runs.jsonl`` (see run.py).

Writes ``<out>/results.json`` (aggregates), ``<out>/results.md`` (tables) and
``<out>/*.png`` (curves).  Accuracies are fractions; every number is the mean over
seeds of the mean over nodes, ``±`` the standard deviation over seeds.

Usage: ``.venv/bin/python bench/defkt/report.py --out bench/defkt/results``
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.runtime.node.metrics import read_jsonl

LABEL = {"defkt": "Def-KT", "fullavg": "FullAvg", "combo": "Combo"}
COLOR = {"defkt": "tab:red", "fullavg": "tab:blue", "combo": "tab:green"}


def _order(st: str) -> tuple:
    """IID first, then shards by decreasing ζ (increasing heterogeneity)."""
    zeta = int(st.split("ζ=")[1]) if "ζ=" in st else 99
    return (st.split()[0], -zeta)


def setting(r: dict[str, Any]) -> str:
    return f"{r['dataset']} {r['partition']}" + (f" ζ={r['zeta']}" if r["partition"] == "shards" else "")


def variant(r: dict[str, Any]) -> str:
    opts = dict(r["options"]) if r["options"] else {}
    name = LABEL.get(r["algorithm"], r["algorithm"])
    if opts.get("mode") == "gossip":
        name += " gossip"
    if opts.get("scope") == "all":
        name += " (all, broadcast)"
    if opts.get("M", 1) != 1:
        name += f" M={opts['M']}"
    return name


def _at(curve: list[dict[str, Any]], key: str, t: int) -> float:
    for c in curve:
        if c["round"] == t:
            return c[key]
    raise KeyError(t)


def _interp(curve: list[dict[str, Any]], key: str, budget: float, xkey: str = "bytes_cum") -> float:
    xs = np.array([c[xkey] for c in curve], dtype=float)
    ys = np.array([c[key] for c in curve], dtype=float)
    if budget > xs[-1] * 1.001 or budget < xs[0]:
        return float("nan")
    return float(np.interp(budget, xs, ys))


def _ms(vals: list[float]) -> tuple[float, float]:
    v = [x for x in vals if not math.isnan(x)]
    if not v:
        return float("nan"), float("nan")
    return float(np.mean(v)), float(np.std(v))


def _fmt(m: float, s: float) -> str:
    return "—" if math.isnan(m) else f"{m:.3f} ± {s:.3f}"


def group(runs: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    g: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        g[(r["part"], setting(r), variant(r), r["algorithm"])].append(r)
    return g


def fixed_round_table(groups, part: str, lines: list[str], summary: dict) -> None:
    settings = sorted({k[1] for k in groups if k[0] == part}, key=_order)
    for st in settings:
        keys = [k for k in groups if k[0] == part and k[1] == st]
        runs0 = groups[keys[0]]
        rounds = runs0[0]["rounds"]
        marks = sorted({rounds // 3 // runs0[0]["eval_every"] * runs0[0]["eval_every"] or 1,
                        2 * rounds // 3 // runs0[0]["eval_every"] * runs0[0]["eval_every"], rounds})
        k_nodes = runs0[0]["nodes"]
        q = dict(runs0[0]["options"]).get("Q", 1)
        lines.append(f"\n### {st} — K = {k_nodes}, Q = {q}, {len(runs0)} seeds\n")
        head = " | ".join(f"global @{t}" for t in marks) + " | " + " | ".join(f"local @{t}" for t in marks)
        lines.append(f"| algorithm | {head} | MB sent @{rounds} |")
        lines.append("|---|" + "---|" * (2 * len(marks) + 1))
        for k in sorted(keys, key=lambda k: list(LABEL).index(k[3]) if k[3] in LABEL else 9):
            rs = groups[k]
            cells = []
            for key in ("global_mean", "local_mean"):
                for t in marks:
                    cells.append(_fmt(*_ms([_at(r["curve"], key, t) for r in rs])))
            mb = np.mean([r["curve"][-1]["bytes_cum"] for r in rs]) / 1e6
            lines.append(f"| {k[2]} | " + " | ".join(cells) + f" | {mb:.1f} |")
            summary.setdefault(part, {}).setdefault(st, {})[k[2]] = {
                "rounds": marks,
                "global": {t: _ms([_at(r["curve"], "global_mean", t) for r in rs]) for t in marks},
                "local": {t: _ms([_at(r["curve"], "local_mean", t) for r in rs]) for t in marks},
                "global_per_seed_final": [r["curve"][-1]["global_mean"] for r in sorted(rs, key=lambda r: r["seed"])],
                "local_per_seed_final": [r["curve"][-1]["local_mean"] for r in sorted(rs, key=lambda r: r["seed"])],
                "mb_sent_final": mb,
            }


def acceptance(summary: dict, part: str, lines: list[str]) -> None:
    """Def-KT minus the best of FullAvg/Combo at the final round, per setting."""
    lines.append(f"\n### Acceptance, part {part}: Def-KT − best baseline at the last round (and at 2/3 of the rounds)\n")
    lines.append("| setting | Δ global (last) | Δ local (last) | Δ global (2/3) | Δ local (2/3) | seeds Def-KT beats both (global / local, last) |")
    lines.append("|---|---|---|---|---|---|")
    for st, algs in summary.get(part, {}).items():
        if "Def-KT" not in algs:
            continue
        d = algs["Def-KT"]
        base = [v for k, v in algs.items() if k in ("FullAvg", "Combo")]
        last, mid = d["rounds"][-1], d["rounds"][-2]
        cells = []
        for t in (last, mid):
            for key in ("global", "local"):
                cells.append(d[key][t][0] - max(b[key][t][0] for b in base))
        wins = []
        for key in ("global_per_seed_final", "local_per_seed_final"):
            n = sum(all(d[key][i] > b[key][i] for b in base) for i in range(len(d[key])))
            wins.append(f"{n}/{len(d[key])}")
        lines.append(f"| {st} | {cells[0]:+.3f} | {cells[1]:+.3f} | {cells[2]:+.3f} | {cells[3]:+.3f} | {' / '.join(wins)} |")
        d["delta_last"] = {"global": cells[0], "local": cells[1]}
        d["delta_two_thirds"] = {"global": cells[2], "local": cells[3]}


def _bytes_name(r: dict[str, Any]) -> str:
    opts = dict(r["options"]) if r["options"] else {}
    rounds = opts.get("mode", "rounds") == "rounds" and opts.get("scope", "pair") == "pair"
    return variant(r) + (" rounds" if rounds else "")


def control_table(runs, lines: list[str], summary: dict) -> None:
    """Part E: the baselines with M = 2 (as many epochs on the travelling model as Def-KT)."""
    if not any(r["part"] == "E" for r in runs):
        return
    lines.append("\n## Part E: local-compute control (baselines with M = 2), ζ = 2, K = 10, Q = 1\n")
    lines.append("Def-KT's travelling model gets M = 1 epoch at the sender and E = 1 epoch of transfer at the "
                 "receiver per round; FullAvg/Combo with M = 2 give it as many epochs.\n")
    lines.append("| setting | variant | global @2/3 | global @last | local @2/3 | local @last |")
    lines.append("|---|---|---|---|---|---|")
    out = {}
    for ds in ("digits", "har"):
        sel = [r for r in runs if r["dataset"] == ds and r["partition"] == "shards" and r["zeta"] == 2
               and r["nodes"] == 10 and r["part"] in ("A", "E")]
        g: dict[str, list] = collections.defaultdict(list)
        for r in sel:
            g[variant(r)].append(r)
        for name in sorted(g, key=lambda n: (n.split()[0] != "Def-KT", n)):
            rs = g[name]
            last = rs[0]["rounds"]
            mid = 2 * last // 3 // rs[0]["eval_every"] * rs[0]["eval_every"]
            cells = [_fmt(*_ms([_at(r["curve"], k, t) for r in rs])) for k in ("global_mean", "local_mean")
                     for t in (mid, last)]
            lines.append(f"| {ds} ζ=2 | {name} | " + " | ".join(cells) + " |")
            out[f"{ds} {name}"] = {k: _ms([_at(r["curve"], k, last) for r in rs]) for k in ("global_mean", "local_mean")}
    summary["E_control"] = out


def equal_bytes_table(runs, lines: list[str], summary: dict) -> None:
    """Digits ζ = 2, K = 10: rounds-mode pair algorithms vs gossip and broadcast FullAvg."""
    sel = [r for r in runs if r["dataset"] == "digits" and r["partition"] == "shards" and r["zeta"] == 2
           and r["nodes"] == 10]
    g: dict[str, list] = collections.defaultdict(list)
    for r in sel:
        g[_bytes_name(r)].append(r)
    if not g:
        return
    top = min(max(r["curve"][-1]["bytes_cum"] for r in rs) for rs in g.values())
    budgets = [top * f for f in (0.25, 0.5, 0.75, 1.0)]
    lines.append("\n### Equal bytes: digits ζ = 2, K = 10 (accuracy at a budget of MB sent by all nodes together)\n")
    lines.append("| variant | " + " | ".join(f"global @{b / 1e6:.0f} MB" for b in budgets) + " | "
                 + " | ".join(f"local @{b / 1e6:.0f} MB" for b in budgets) + " | MB received @last |")
    lines.append("|---|" + "---|" * (2 * len(budgets) + 1))
    out = {}
    for name in sorted(g):
        rs = g[name]
        cells = [_fmt(*_ms([_interp(r["curve"], key, b) for r in rs])) for key in ("global_mean", "local_mean")
                 for b in budgets]
        recv = np.mean([r["curve"][-1].get("bytes_received_cum", float("nan")) for r in rs]) / 1e6
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {recv:.0f} |")
        out[name] = {f"{b / 1e6:.0f}MB": {k: _ms([_interp(r["curve"], k, b) for r in rs])
                                         for k in ("global_mean", "local_mean")} for b in budgets}
    summary["equal_bytes_digits_zeta2"] = out


def _mean_curve(rs, key, xkey="round"):
    xs = [c[xkey] for c in rs[0]["curve"]]
    ys = np.array([[c[key] for c in r["curve"]] for r in rs if len(r["curve"]) == len(xs)])
    if xkey != "round":
        xs = list(np.mean([[c[xkey] for c in r["curve"]] for r in rs if len(r["curve"]) == len(xs)], axis=0))
    return np.array(xs, dtype=float), ys.mean(0), ys.std(0)


def plot_part(groups, part: str, path: Path, title: str, dataset: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({k[1] for k in groups if k[0] == part and (dataset is None or k[1].startswith(dataset))},
                      key=_order)
    if not settings:
        return
    fig, axes = plt.subplots(2, len(settings), figsize=(4.2 * len(settings), 7), dpi=100, squeeze=False)
    for j, st in enumerate(settings):
        for k in [k for k in groups if k[0] == part and k[1] == st]:
            rs = groups[k]
            for i, key in enumerate(("global_mean", "local_mean")):
                x, m, s = _mean_curve(rs, key)
                ax = axes[i][j]
                ax.plot(x, m, color=COLOR.get(k[3]), label=k[2])
                ax.fill_between(x, m - s, m + s, color=COLOR.get(k[3]), alpha=0.15)
        for i, what in enumerate(("global", "local")):
            ax = axes[i][j]
            ax.set_title(f"{st}: {what} accuracy", fontsize=9)
            ax.set_xlabel("round")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0][j].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bytes(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in runs if r["dataset"] == "digits" and r["partition"] == "shards" and r["zeta"] == 2
           and r["nodes"] == 10]
    g: dict[str, list] = collections.defaultdict(list)
    for r in sel:
        g[_bytes_name(r)].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    def style(name: str) -> str:  # rounds: solid, gossip: dotted, broadcast: dash-dot, M = 2: dashed
        return ":" if "gossip" in name else "-." if "broadcast" in name else "--" if "M=2" in name else "-"

    for name, rs in sorted(g.items()):
        for ax, key in zip(axes, ("global_mean", "local_mean")):
            x, m, s = _mean_curve(rs, key, "bytes_cum")
            ax.plot(x / 1e6, m, linestyle=style(name), color=COLOR.get(rs[0]["algorithm"]), label=name,
                    linewidth=2.2 if rs[0]["algorithm"] == "defkt" else 1.4)
    for ax, what in zip(axes, ("global", "local")):
        ax.set_xlabel("MB sent by all nodes (cumulative)")
        ax.set_ylabel(f"{what} accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("digits ζ = 2, K = 10: accuracy at equal bytes (mean of 3 seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench/defkt/results")
    a = p.parse_args()
    out = Path(a.out)
    runs = read_jsonl(out / "runs.jsonl")
    groups = group(runs)
    summary: dict[str, Any] = {}
    lines = ["# Def-KT benchmark results", "",
             "Generated by `bench/defkt/report.py` from `runs.jsonl`; see `../README.md` for the command, "
             "settings and analysis. Mean over seeds of the mean over nodes ± std over seeds.", ""]
    parts = {"A": "K = 10 nodes, Q = 1 (the paper's setting)", "B": "K = 50 nodes, Q = 5"}
    for part, title in parts.items():
        if not any(k[0] == part for k in groups):
            continue
        lines.append(f"\n## Part {part}: {title}")
        fixed_round_table(groups, part, lines, summary)
        acceptance(summary, part, lines)
        for ds in ("digits", "har"):
            plot_part(groups, part, out / f"part{part}_{ds}.png",
                      f"Part {part}: {title}, {ds}; line = mean of seeds, band = ± std over seeds", ds)
    if any(k[0] in ("C", "D") for k in groups):
        lines.append("\n## Parts C and D: gossip mode and broadcast FullAvg vs rounds mode at equal bytes")
        equal_bytes_table(runs, lines, summary)
        plot_bytes(runs, out / "equal_bytes.png")
    control_table(runs, lines, summary)
    walls = collections.defaultdict(float)
    for r in runs:
        walls[r["part"]] += r["wall_seconds"]
    lines.append("\n## Wall time (simulate() only, a 2-core x86_64 VM with no GPU)\n")
    lines.append("| part | runs | wall |")
    lines.append("|---|---|---|")
    for part in sorted(walls):
        lines.append(f"| {part} | {sum(r['part'] == part for r in runs)} | {walls[part] / 60:.1f} min |")
    summary["wall_seconds_by_part"] = dict(walls)
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
