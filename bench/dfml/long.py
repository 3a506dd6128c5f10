"""Horizon check for the ablation: WSM cyclic vs fixed α over 104 rounds (end of the
fourth α cycle), digits non-IID, H2, seed 0.  Usage: nice -n 10 .venv/bin/python bench/dfml/long.py"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dfl_agent.cli.progress import simulate_with_progress as simulate  # noqa: E402  (progress on stderr)
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.runtime.node.simulator import SimConfig  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "long"
OUT.mkdir(parents=True, exist_ok=True)
for name, opts in (("cyclic", {}), ("fixed", {"alpha_mode": "fixed"}), ("cyclic_top2", {"peak_top_k": 2})):
    path = OUT / f"{name}.json"
    if path.exists():
        continue
    s = simulate(SimConfig(algorithm="dfml", nodes=20, rounds=104, dataset="digits", partition="dirichlet", beta=0.1,
                           model_family="H2", seed=0, options=opts, train=TrainConfig(batch_size=64, lr=0.05)))
    s.pop("config", None)
    path.write_text(json.dumps({"name": name, "options": opts, "summary": s}, default=str))
    print(name, s["global_accuracy"]["mean"], s.get("regular_global_accuracy", {}).get("mean"), flush=True)
