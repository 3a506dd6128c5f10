#!/usr/bin/env bash
# Acceptance runs of the main job: the default demo, and the demo with one agent
# SIGKILLed after its round 5. Copies each summary.json into bench/results/.
# Usage: bench/demo_har.sh   (from the repository root, after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
DFLCTL=${DFLCTL:-.venv/bin/dflctl}
rm -rf /tmp/bench_demo /tmp/bench_demo_kill
$DFLCTL demo --no-live --algorithm fedavg --out /tmp/bench_demo | tail -14
cp /tmp/bench_demo/summary.json bench/results/demo_fedavg_har_5x20.json
cp /tmp/bench_demo/accuracy.png bench/results/demo_fedavg_har_5x20.png
$DFLCTL demo --no-live --algorithm fedavg --kill 2@5 --out /tmp/bench_demo_kill | tail -14
cp /tmp/bench_demo_kill/summary.json bench/results/demo_fedavg_har_5x20_kill2at5.json
