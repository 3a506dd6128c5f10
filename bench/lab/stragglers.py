"""Stragglers, from field-lab output folders (``dflctl lab run ... --out DIR``).

For each folder: the fast devices' time to accuracy (the lab's measure, ``TARGET`` held-out
accuracy, here over the fast devices only: every device but the slow ones), and what their
round records say about the slow device's updates: ``late_used`` (used after their round,
with FedAsync's staleness weight), on time, and the rounds' ``deadline_s``.

    python bench/lab/stragglers.py --slow slow-0 even=DIR1 quorum=DIR2 paper=DIR3 [--json OUT]

The first folder is the baseline of the ratio (all devices equally fast).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from dfl_agent.cli.lab.accuracy import TARGET, accuracy_curve, time_to_accuracy


def _records(folder: Path, device: str) -> list[dict[str, Any]]:
    out = []
    for f in sorted((folder / "metrics" / device).glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("round"), int):
                out.append(rec)
    return out


def summarize(folder: Path, slow: set[str]) -> dict[str, Any]:
    """One folder's row (see the module docstring)."""
    rep = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    devices = [d for d in rep["devices"] if d.get("role") != "inference"]
    fast = [d["id"] for d in devices if d["id"] not in slow]
    run = rep["runs"][0]
    curve = accuracy_curve({d["id"]: d.get("round_accuracy") or [] for d in devices if d["id"] in fast})
    tta = time_to_accuracy(curve, run.get("submitted_s"), TARGET)
    # the same from the end of the fast devices' first round (leaves out the run processes'
    # start-up, which a slow device does not change)
    first = next((p[0] for p in curve if int(p[1]) == 1), None)
    from_first = (round(tta["seconds"] + run.get("submitted_s", 0.0) - first, 1)
                  if tta["seconds"] is not None and first is not None else None)
    late_from_slow = on_time_from_slow = late_other = 0
    deadlines, rounds, slow_tau = [], {}, []
    for dev in fast:
        recs = _records(folder, dev)
        rounds[dev] = max((r["round"] for r in recs), default=0)
        for r in recs:
            late = {s for s, _ in r.get("late_weights") or []}
            # FedAsync's weight s(τ) = (τ + 1)^-0.5 gives the update's staleness τ back
            slow_tau += [round(w ** -2 - 1) for s, w in r.get("late_weights") or [] if s in slow and w > 0]
            late_from_slow += len(late & slow)
            late_other += len(late - slow)
            on_time_from_slow += len((set(r.get("neighbour_ids") or []) & slow) - late)
            if isinstance(r.get("deadline_s"), (int, float)):
                deadlines.append(float(r["deadline_s"]))
    slow_recs = {d: _records(folder, d) for d in slow}
    slow_rounds = {d: max((r["round"] for r in rs), default=0) for d, rs in slow_recs.items()}
    # the fast devices' seconds per round while a slow device trains (from its first round
    # record on; all rounds when there is none), from their records' times
    since = min((float(r["time"]) for rs in slow_recs.values() for r in rs if "time" in r), default=None)
    per_round = []
    for dev in fast:
        times = sorted(float(r["time"]) for r in _records(folder, dev) if "time" in r
                       and (since is None or float(r["time"]) >= since))
        if len(times) >= 2:
            per_round.append((times[-1] - times[0]) / (len(times) - 1))
    return {"folder": str(folder), "passed": rep.get("passed"), "fast_devices": fast,
            "time_to_target_s": tta["seconds"], "target_round": tta["round"], "best_fast_mean": tta["best"],
            "time_to_target_from_round_1_s": from_first, "round_1_s": first,
            "fast_rounds": rounds, "slow_rounds": slow_rounds,
            "slow_updates_late_used": late_from_slow, "slow_updates_on_time": on_time_from_slow,
            "slow_updates_staleness": [min(slow_tau), max(slow_tau)] if slow_tau else None,
            "final_accuracy_mean": run.get("final_accuracy_mean"),
            "other_late_used": late_other,
            "deadline_s_median": statistics.median(deadlines) if deadlines else None,
            "fast_s_per_round_while_slow_trains": round(statistics.mean(per_round), 3) if per_round else None,
            "slow_first_round_time": since,
            "wall_seconds": rep.get("wall_seconds")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=DIR (a NAME may repeat: repeats of one scenario), "
                    "the baseline's NAME first")
    ap.add_argument("--slow", default="slow-0", help="comma-separated slow devices")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    slow = set(a.slow.split(","))
    rows: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for item in a.runs:
        name, _, d = item.partition("=")
        if not (Path(d) / "report.json").exists():
            print(f"stragglers: {d}/report.json not found (a lab --out folder?)", file=sys.stderr)
            return 2
        groups.setdefault(name, []).append(summarize(Path(d), slow))
    rows = {f"{n}{i + 1}": r for n, rs in groups.items() for i, r in enumerate(rs)}

    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in groups[name] if r[key] is not None]
        return statistics.median(vals) if vals else None

    base_name = next(iter(groups))
    base, base1 = med(base_name, "time_to_target_s"), med(base_name, "time_to_target_from_round_1_s")
    print(f"| run | fast devices' time to {TARGET:.2f} (s) | from round 1 (s) | round | fast rounds | slow rounds "
          "| slow updates used late / on time (staleness τ) | median deadline (s) "
          "| fast s/round while the slow one trains | final accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        t = r["time_to_target_s"]
        tau = r["slow_updates_staleness"]
        print(f"| {name} | {t if t is not None else 'never (best ' + str(r['best_fast_mean']) + ')'} "
              f"| {r['time_to_target_from_round_1_s']} "
              f"| {r['target_round']} | {min(r['fast_rounds'].values(), default=0)}-{max(r['fast_rounds'].values(), default=0)} "
              f"| {', '.join(str(v) for v in r['slow_rounds'].values())} | {r['slow_updates_late_used']} / "
              f"{r['slow_updates_on_time']}{f' (τ {tau[0]}-{tau[1]})' if tau else ''} | {r['deadline_s_median']} "
              f"| {r['fast_s_per_round_while_slow_trains']} | {r['final_accuracy_mean']} |")
    print()
    print(f"| scenario | runs | median time to {TARGET:.2f} (s) | × {base_name} | median from round 1 (s) | × {base_name} |")
    print("|---|---|---|---|---|---|")
    for name in groups:
        t, t1 = med(name, "time_to_target_s"), med(name, "time_to_target_from_round_1_s")
        print(f"| {name} | {len(groups[name])} | {t} | {f'{t / base:.2f}' if t and base else '-'} "
              f"| {t1} | {f'{t1 / base1:.2f}' if t1 and base1 else '-'} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
