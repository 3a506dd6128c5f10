"""FedD2S against ``local`` at the simulator's defaults (the setting of
``tests/integration/test_algorithms_beat_local.py``): why E = 1 pass per distillation phase
stays below training alone, and E = 4 (the paper's Table 2 setting, §IV-A) does not.

Label-skewed HAR (Dirichlet β = 0.5), 4 nodes, 20 rounds, the fixed stratified HAR subset
of ``bench/dechw/run.py`` (1200 pool / 1000 test windows), simulator defaults otherwise.
The compared figure is each node's personal model on its own validation split after the
last round, averaged over nodes (``local_accuracy``); for ``local`` the same figure.

For E = 1 and E = 4 it also records, per node, how many rounds the node was drawn
(participations Z_n) and its own-data accuracy: with ρ = 0.2 of 4 nodes one node is drawn
per round, and a node's personal model is trained only when it is drawn (seed 002,
Algorithm 1 and §III: "a subset of clients ... is activated").

Command (from the repository root; ~5 min on a loaded 2-core VM)::

    nice -n 10 .venv/bin/python bench/fedd2s/beat_local.py --seeds 0,1,2

Writes ``bench/fedd2s/results/beat_local.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.dechw.run import har_dir  # noqa: E402
from dfl_agent.runtime.node.simulator import SimConfig, simulate  # noqa: E402

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "local": ("local", {}),
    "fedd2s E=1": ("fedd2s", {"c2s_epochs": 1, "s2c_epochs": 1}),
    "fedd2s E=4": ("fedd2s", {"c2s_epochs": 4, "s2c_epochs": 4}),
}


def run(name: str, seed: int, rounds: int, data: Path) -> dict[str, Any]:
    """One simulator run; returns the mean accuracies and, per node, Z_n and own-data accuracy."""
    algo, opts = VARIANTS[name]
    out = Path(tempfile.mkdtemp(prefix="fedd2s_beat_local_"))
    t0 = time.time()
    s = simulate(SimConfig(algorithm=algo, dataset="npz", dataset_path=str(data), partition="dirichlet", nodes=4,
                           rounds=rounds, seed=seed, threads=1, eval_every=rounds, options=opts, out=str(out)))
    last: dict[str, dict[str, Any]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("round") == rounds and "local_accuracy" in r:
            last[r["node"]] = {"participations": r.get("participations"), "own_accuracy": r["local_accuracy"]}
    return {"variant": name, "algorithm": algo, "options": opts, "seed": seed, "rounds": rounds,
            "own_accuracy": float(s["local_accuracy"]["mean"]), "global_accuracy": float(s["global_accuracy"]["mean"]),
            "per_node": dict(sorted(last.items())), "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per run")
    ap.add_argument("--out", default=str(ROOT / "bench/fedd2s/results/beat_local.json"), help="result JSON")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    data = har_dir(Path(tempfile.gettempdir()) / "dfl_beat_local", 1200, 1000)
    runs = [run(v, int(s), a.rounds, data) for s in a.seeds.split(",") for v in VARIANTS]
    Path(a.out).write_text(json.dumps({"command": "nice -n 10 .venv/bin/python bench/fedd2s/beat_local.py "
                                       f"--seeds {a.seeds} --rounds {a.rounds}", "runs": runs}, indent=1) + "\n")
    print("| seed | " + " | ".join(VARIANTS) + " |\n|---|" + "---|" * len(VARIANTS))
    for s in a.seeds.split(","):
        row = {r["variant"]: r["own_accuracy"] for r in runs if r["seed"] == int(s)}
        print(f"| {s} | " + " | ".join(f"{row[v]:.3f}" for v in VARIANTS) + " |")
    print("\nper node (participations Z_n, own-data accuracy):")
    for r in runs:
        if r["algorithm"] == "fedd2s":
            print(r["seed"], r["variant"], {n: (p["participations"], round(p["own_accuracy"], 3))
                                            for n, p in r["per_node"].items()})


if __name__ == "__main__":
    main()
