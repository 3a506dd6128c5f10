#!/usr/bin/env bash
# Signed demos (the demo always requires signatures), same seed, same commit: FedAvg on HAR
# with --compression none, q8 and topk:0.01+q8 (error feedback on: CHOCO copies).
# Copies each summary.json into bench/compression/results/signed_demo/ and writes
# results.md there (accuracy, accuracy of the same models trained alone, bytes, drops).
# Usage: bench/compression/signed_demo.sh   (from the repository root, after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
DFLCTL=${DFLCTL:-.venv/bin/dflctl}
PY=${PY:-.venv/bin/python}
SEED=${SEED:-0}
OUT=bench/compression/results/signed_demo
mkdir -p "$OUT"
for spec in none q8 topk:0.01+q8; do
  name=${spec//[:+]/_}
  rm -rf "/tmp/signed_demo_$name"
  $DFLCTL demo --no-live --algorithm fedavg --seed "$SEED" --compression "$spec" --out "/tmp/signed_demo_$name" | tail -3
  cp "/tmp/signed_demo_$name/summary.json" "$OUT/fedavg_$name.json"
  # frames dropped per reason and node (the three reasons of a broken signed x compressed path)
  $PY - "/tmp/signed_demo_$name" > "$OUT/fedavg_${name}_drops.json" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
out = {}
for log in sorted((d / "logs").glob("*.log")):
    text = log.read_text(errors="replace")
    out[log.name] = {r: text.count(r) for r in ("bad_encoding", "bad_signature", "non_finite")}
recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
out["rounds_with_no_neighbour"] = sum(1 for r in recs if r.get("neighbours") == 0)
out["round_records"] = len(recs)
out["max_dropped"] = max((r.get("dropped", 0) for r in recs), default=0)
last = {}
for r in recs:
    if r.get("node") and r["round"] >= last.get(r["node"], {}).get("round", -1):
        last[r["node"]] = r
ratios = [r["compression_ratio"] for r in last.values() if "compression_ratio" in r]
out["compression_ratio_mean"] = sum(ratios) / len(ratios) if ratios else None
print(json.dumps(out, indent=1))
PY
done
$PY - "$OUT" "$SEED" "$(git rev-parse --short HEAD)" > "$OUT/results.md" <<'PY'
import json, sys, pathlib
out, seed, commit = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"# Signed demos with and without compression (seed {seed}, commit {commit})\n")
print("Command: `bench/compression/signed_demo.sh` (each: `dflctl demo --no-live --algorithm fedavg "
      f"--seed {seed} --compression SPEC`; 5 agents, 20 rounds, signatures required).\n")
print("| compression | federated | alone | gain (points) | MB sent | ratio vs float32 | rounds with 0 neighbours | bad_encoding / bad_signature / non_finite |")
print("|---|---|---|---|---|---|---|---|")
rows = {}
for spec in ("none", "q8", "topk:0.01+q8"):
    name = spec.replace(":", "_").replace("+", "_")
    s = json.loads((out / f"fedavg_{name}.json").read_text())
    d = json.loads((out / f"fedavg_{name}_drops.json").read_text())
    g, lo = s["global_accuracy"]["mean"], s.get("local_only_global_accuracy", {}).get("mean", float("nan"))
    bad = [sum(v[r] for k, v in d.items() if isinstance(v, dict)) for r in ("bad_encoding", "bad_signature", "non_finite")]
    ratio = d.get("compression_ratio_mean")
    rows[spec] = (g, lo)
    print(f"| `{spec}` | {100*g:.1f} % | {100*lo:.1f} % | {100*(g-lo):+.1f} | {s['bytes_sent']/1e6:.2f} | "
          f"{'' if ratio is None else f'{ratio:.1f}x'} | {d['rounds_with_no_neighbour']} of {d['round_records']} | {bad[0]} / {bad[1]} / {bad[2]} |")
(gn, ln), (gq, lq) = rows["none"], rows["q8"]
print(f"\n(acc_q8 - alone_q8) - (acc_none - alone_none) = {100*((gq-lq)-(gn-ln)):+.1f} points (target: >= -2).")
PY
cat "$OUT/results.md"
