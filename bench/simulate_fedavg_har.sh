#!/usr/bin/env bash
# Acceptance benchmark of the foundation: the simulator's speed and accuracy on HAR,
# and the same federation's local-only floor. Writes bench/results/*.json.
# Usage: bench/simulate_fedavg_har.sh   (from the repository root, after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=bench/results
for alg in fedavg local; do
  /usr/bin/time -f "%e s wall, %M KB max RSS" -o "/tmp/bench_$alg.time" \
    "$PY" -m dfl_agent.cli.dflctl simulate --algorithm "$alg" --nodes 10 --rounds 20 --dataset har \
      --partition by-user --seed 0 --out "/tmp/bench_sim_$alg"
  "$PY" - "$alg" <<'PY'
import json, sys, platform, os
alg = sys.argv[1]
s = json.load(open(f"/tmp/bench_sim_{alg}/summary.json"))
t = open(f"/tmp/bench_{alg}.time").read().strip()
res = {k: s[k] for k in ("algorithm", "nodes", "rounds_completed", "wall_seconds", "bytes_sent", "bytes_received")}
res["global_accuracy_mean"] = s["global_accuracy"]["mean"]
res["local_accuracy_mean"] = s["local_accuracy"]["mean"]
res["process"] = t
res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
res["command"] = (f"dflctl simulate --algorithm {alg} --nodes 10 --rounds 20 --dataset har "
                  "--partition by-user --seed 0")
json.dump(res, open(f"bench/results/simulate_{alg}_har_10x20.json", "w"), indent=2)
print(json.dumps(res, indent=2))
PY
done
