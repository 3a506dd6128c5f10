"""Why the residual matters: CHOCO gossip (no training) on the digits model's size.

8 nodes on a ring, each starting from a different random vector of 17 226 values (the
digits MLP), run compressed gossip with Metropolis weights 1/3; consensus error =
mean_i ‖x_i − x̄(0)‖ / ‖x̄(0)‖ (the average is what exact gossip converges to) against
the bytes of the compressed payloads.  With error feedback (CHOCO's copies) the error
falls; without it, what top-k drops is lost and the nodes drift.

Usage: nice -n 10 .venv/bin/python bench/compression/gossip.py   (about 2 min on 1 core)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def run(spec: str, ef: bool, iters: int, n: int = 8, d: int = 17226, seed: int = 0):
    from dfl_agent.learning.compression import decompress_dict
    from dfl_agent.learning.error_feedback import ChocoGossip

    rng = np.random.default_rng(seed)
    xs = [{"w": rng.normal(size=d).astype(np.float32)} for _ in range(n)]
    target = np.mean([x["w"] for x in xs], axis=0)
    nodes = [ChocoGossip(spec, np.random.default_rng([seed, i]), error_feedback=ef) for i in range(n)]
    err, sent = [], []
    total = 0
    for _ in range(iters):
        msgs = []
        for i in range(n):
            blob, desc, meta = nodes[i].outgoing(xs[i])
            total += blob.size * 2  # to both ring neighbours
            msgs.append((decompress_dict(blob, desc), meta))
        new = []
        for i in range(n):
            nb = [(i - 1) % n, (i + 1) % n]
            copies = [nodes[i].own_copy()] + [nodes[i].incoming(f"n{j}", *msgs[j]) for j in nb]
            new.append(nodes[i].mix(xs[i], {"w": np.mean([c["w"] for c in copies], axis=0)}))
        xs = new
        err.append(float(np.mean([np.linalg.norm(x["w"] - target) for x in xs]) / np.linalg.norm(target)))
        sent.append(total)
    return err, sent


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec, ef, iters in [("none", True, 60), ("q8", True, 60), ("topk:0.1+q8", True, 300), ("topk:0.1+q8", False, 300),
                            ("topk:0.01+q8", True, 1500), ("topk:0.01+q8", False, 1500)]:
        err, sent = run(spec, ef, iters)
        key = spec + ("" if ef else " no EF")
        out[key] = {"iterations": iters, "final_error": err[-1], "bytes": sent[-1], "error": err[::10], "sent": sent[::10]}
        ax.plot(np.array(sent) / 1e6, err, label=key)
        print(f"{key}: {iters} iterations, error {err[-1]:.3g}, {sent[-1] / 1e6:.2f} MB", flush=True)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MB of payload sent (all nodes)")
    ax.set_ylabel("consensus error")
    ax.set_title("CHOCO gossip, 8-node ring, 17 226 values")
    ax.legend(fontsize=7)
    fig.tight_layout()
    (HERE / "results").mkdir(exist_ok=True)
    fig.savefig(HERE / "results" / "gossip.png", dpi=90)
    (HERE / "results" / "gossip.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    main()
