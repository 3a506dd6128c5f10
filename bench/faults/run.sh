#!/usr/bin/env bash
# Chaos benchmark: 6 signed agents (fedavg, HAR by user, medium model) on a local
# mosquitto; fault-free reference, then the same federation with one agent killed (SIGKILL)
# every 30 s for 3 minutes (each restarted 2 s later, rejoining at the current round) and one
# broker restart 90 s into the chaos window.  Results: bench/faults/{reference,chaos}.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/dfl-faults}
COMMON="--nodes 6 --rounds ${ROUNDS:-90} --model-size medium --round-timeout 10 --seed 0"
nice -n 10 $PY -m dfl_agent.cli.chaos --out $OUT/reference $COMMON --no-faults
cp $OUT/reference/chaos.json bench/faults/reference.json
nice -n 10 $PY -m dfl_agent.cli.chaos --out $OUT/chaos $COMMON --kill-every 30 --chaos-seconds 180 --broker-restart-at 90 \
  || true
cp $OUT/chaos/chaos.json bench/faults/chaos.json
