"""Sparsified gossip in its own regime: one SGD step per gossip round (CHOCO-SGD).

The main grid (``run.py``) trains a whole epoch between two gossip rounds, 10–100 rounds in
all; there, top-1 % CHOCO gossip cannot mix the models in time (−20 pt).  CHOCO-SGD
(Koloskova et al. 2019, Alg. 1; the MoDeFL thesis §3.6.4) gossips after *every* SGD step, so the
compressed copies x̂ track models that move a little per round.  This benchmark runs that
setting on the real simulator (``training.steps = 1``): 6 nodes, 2 000 rounds, SGD lr 0.1
without momentum (a fresh optimizer per round carries none), batch 32; accuracy at equal
rounds against float32 gossip of the same seed.

Sparsified streams resend a keyframe every 100 messages (the default since these runs showed
that without it a top-1 % run drifts and collapses after ~2 400 rounds; the first runs,
keyframe at the first message only, are kept in ``results/steps/first-keyframe-only/``).

γ (``consensus_step``) of a sparsified spec is chosen on *validation* data: seed 0 runs at
each γ in ``GAMMAS``; the γ with the best mean validation accuracy (each node's held-out
20 %, ``local_accuracy``) wins; the test split is not read.  The run without error feedback
uses the same γ.  Seeds 0–2 then run at the chosen γ.

Usage (from the repository root; each run is saved to results/steps/<name>.json, reruns skip it):
    nice -n 10 .venv/bin/python bench/compression/steps.py gamma [--only SUBSTRING]
    nice -n 10 .venv/bin/python bench/compression/steps.py grid  [--only SUBSTRING] [--rounds 4000 --specs none,topk:0.01+q8]
    .venv/bin/python bench/compression/steps.py report          # results/steps.md, steps-*.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "steps"
ROUNDS = 2000
LONG = 4000  # the longer horizon (digits, fedavg): does the top-1 % gap keep closing?
SEEDS = (0, 1, 2)
SETTINGS = {
    "digits-fedavg": dict(dataset="digits", nodes=6, partition="dirichlet", beta=0.5, algorithm="fedavg"),
    "har-fedavg": dict(dataset="har", nodes=6, partition="by-user", algorithm="fedavg"),
    "digits-dechw": dict(dataset="digits", nodes=6, partition="dirichlet", beta=0.5, algorithm="dechw"),
}
SPECS = [("none", True), ("q8", True), ("topk:0.01+q8", True), ("topk:0.01+q8", False),
         ("topk:0.1+q8", True), ("topk:0.1+q8", False)]
NO_EF_SEEDS = {"har-fedavg": (0,), "digits-dechw": (0,)}  # without error feedback: seeds (default SEEDS)
SETTING_SEEDS = {"digits-dechw": (0,)}  # CPU budget: dechw on seed 0 only
GAMMAS = {"topk:0.01+q8": (0.03, 0.05), "topk:0.1+q8": (0.1, 0.2)}


def tag(spec: str, ef: bool) -> str:
    return spec.replace(":", "").replace("+", "_").replace(".", "") + ("" if ef else "-noEF")


def name(setting: str, spec: str, ef: bool, gamma: float, seed: int, rounds: int = ROUNDS) -> str:
    horizon = "" if rounds == ROUNDS else f"-r{rounds}"
    return f"{setting}-{tag(spec, ef)}{'-g%g' % gamma if gamma else ''}{horizon}-s{seed}"


def run(setting: str, spec: str, ef: bool, gamma: float, seed: int, rounds: int = ROUNDS) -> dict:
    """One simulator run (skipped when its file exists); returns the saved record."""
    from dfl_agent.cli.progress import simulate_with_progress as simulate  # progress on stderr
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig
    from dfl_agent.transport import wire

    # these runs started before envelope headers were zstd-compressed: keep plain JSON
    # headers so that every run of this benchmark counts bytes the same way
    wire.COMPRESS_HEADERS = False
    path = RUNS / f"{name(setting, spec, ef, gamma, seed, rounds)}.json"
    if path.exists():
        return json.loads(path.read_text())
    RUNS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    s = simulate(SimConfig(rounds=rounds, seed=seed, threads=1, eval_every=rounds // 20, compression=spec,
                           error_feedback=ef, consensus_step=gamma,
                           train=TrainConfig(steps=1, lr=0.1, momentum=0.0, batch_size=32), **SETTINGS[setting]))
    rec = {k: s[k] for k in ("global_accuracy", "local_accuracy", "bytes_sent", "compression_ratio", "curve",
                             "rounds_completed", "float32_bytes_sent")}
    for k in ("global_accuracy", "local_accuracy"):
        rec[k] = {m: v for m, v in rec[k].items() if m != "per_node"}
    rec.update(config=dict(SETTINGS[setting], setting=setting, compression=spec, error_feedback=ef,
                           consensus_step=gamma, seed=seed, rounds=rounds, steps=1, lr=0.1, momentum=0.0,
                           keyframe_every="automatic (sparsified: every 100 messages)"),
               wall_seconds=time.time() - t0)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{path.stem}: test {rec['global_accuracy']['mean']:.4f} val {rec['local_accuracy']['mean']:.4f} "
          f"ratio {rec['compression_ratio']:.1f} ({rec['wall_seconds']:.0f}s)", flush=True)
    return rec


def chosen_gamma(setting: str, spec: str) -> float | None:
    """The γ with the best seed-0 validation accuracy, or None before all its runs exist."""
    best = None
    for g in GAMMAS[spec]:
        p = RUNS / f"{name(setting, spec, True, g, 0)}.json"
        if not p.exists():
            return None
        val = json.loads(p.read_text())["local_accuracy"]["mean"]
        if best is None or val > best[0]:
            best = (val, g)
    return best[1] if best else None


def stage_gamma(only: str | None) -> None:
    for setting in SETTINGS:
        for spec, gammas in GAMMAS.items():
            for g in gammas:
                if not only or only in name(setting, spec, True, g, 0):
                    run(setting, spec, True, g, 0)


def stage_grid(only: str | None, rounds: int = ROUNDS, specs: list[str] | None = None) -> None:
    for seed in SEEDS:
        for setting in SETTINGS:
            for spec, ef in SPECS:
                if specs and spec not in specs:
                    continue
                if only and not (only.startswith(setting) or setting.startswith(only)):
                    continue  # another setting's run
                seeds = SETTING_SEEDS.get(setting, SEEDS) if ef else NO_EF_SEEDS.get(setting, SEEDS)
                if seed not in seeds:
                    continue  # CPU budget: fewer seeds for dechw and for the ablation without residuals
                g = chosen_gamma(setting, spec) if spec in GAMMAS else 0.0
                if g is None:
                    print(f"skip {setting} {spec}: run the gamma stage first", flush=True)
                    continue
                if not only or only in name(setting, spec, ef, g, seed, rounds):
                    run(setting, spec, ef, g, seed, rounds)


def _load() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))}


def report() -> None:
    import numpy as np

    from bench.compression.run import plot_curves

    runs = _load()
    lines = ["# Sparsified gossip, one SGD step per round (CHOCO-SGD regime)", "",
             f"6 nodes, {ROUNDS} rounds of one SGD step (lr 0.1, no momentum, batch 32) and one gossip exchange;",
             "accuracy = mean global test accuracy over nodes after the last round; Δ and × fewer bytes are paired",
             "with float32 (`none`) of the same setting and seed at equal rounds; mean ± std over seeds.",
             "γ of a sparsified spec chosen on validation accuracy (seed 0), see the γ table.",
             "Command: `nice -n 10 .venv/bin/python bench/compression/steps.py gamma && ... steps.py grid && "
             "... steps.py report`.", ""]
    for setting, rounds in [(s, r) for r in (ROUNDS, LONG) for s in SETTINGS]:
        rows = []
        for spec, ef in SPECS:
            g = chosen_gamma(setting, spec) if spec in GAMMAS else 0.0
            if g is None:
                continue
            acc, delta, ratio, mb = [], [], [], []
            for seed in SEEDS:
                r = runs.get(name(setting, spec, ef, g, seed, rounds))
                b = runs.get(name(setting, "none", True, 0.0, seed, rounds))
                if r is None or b is None:
                    continue
                acc.append(100 * r["global_accuracy"]["mean"])
                delta.append(100 * (r["global_accuracy"]["mean"] - b["global_accuracy"]["mean"]))
                ratio.append(b["bytes_sent"] / r["bytes_sent"])
                mb.append(r["bytes_sent"] / 1e6)
            if acc:
                rows.append((spec, ef, g, acc, delta, ratio, mb))
        if not rows:
            continue
        lines += [f"## {setting}, {rounds} rounds", "",
                  "| spec | error feedback | γ | seeds | accuracy (%) | Δ acc (pt) | per seed Δ | × fewer bytes "
                  "| MB sent |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for spec, ef, g, acc, delta, ratio, mb in rows:
            sparse = "topk" in spec
            lines.append(
                f"| `{spec}` | {('on' if ef else 'off') if sparse else '—'} | {g or '—'} | {len(acc)} | "
                f"{np.mean(acc):.2f} ± {np.std(acc):.2f} | {np.mean(delta):+.2f} ± {np.std(delta):.2f} | "
                f"{', '.join('%+.2f' % d for d in delta)} | {np.mean(ratio):.1f} | {np.mean(mb):.2f} |")
        series = []
        for spec, ef in SPECS:
            g = chosen_gamma(setting, spec) if spec in GAMMAS else 0.0
            r = runs.get(name(setting, spec, ef, g or 0.0, 0, rounds)) if g is not None else None
            if r is not None:
                series.append((spec + ("" if ef or "topk" not in spec else " no EF"), r["curve"]))
        png = f"steps-{setting}{'' if rounds == ROUNDS else '-r%d' % rounds}.png"
        plot_curves(series, f"{setting}, {rounds} rounds of 1 step, seed 0", HERE / "results" / png)
        lines += ["", f"![{setting}]({png})", ""]
    lines += ["## γ selection (seed 0, validation accuracy; test shown, not used)", "",
              "| setting | spec | γ | validation (%) | test (%) | chosen |", "|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        for spec, gammas in GAMMAS.items():
            ch = chosen_gamma(setting, spec)
            for g in gammas:
                r = runs.get(name(setting, spec, True, g, 0))
                if r is not None:
                    lines.append(f"| {setting} | `{spec}` | {g} | {100 * r['local_accuracy']['mean']:.2f} | "
                                 f"{100 * r['global_accuracy']['mean']:.2f} | {'yes' if g == ch else ''} |")
    (HERE / "results" / "steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("gamma", "grid", "report"))
    ap.add_argument("--only", help="only runs whose name contains this substring")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"grid: rounds per run (default {ROUNDS}; {LONG} for the longer horizon; γ comes from the "
                    f"{ROUNDS}-round selection)")
    ap.add_argument("--specs", help="grid: comma-separated specs (default: all)")
    a = ap.parse_args(argv)
    if a.stage == "gamma":
        stage_gamma(a.only)
    elif a.stage == "grid":
        stage_grid(a.only, a.rounds, a.specs.split(",") if a.specs else None)
    report()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    import torch

    torch.set_num_threads(1)
    main()
