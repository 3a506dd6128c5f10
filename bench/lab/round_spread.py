"""How much a device's accuracy moves from round to round once a run has settled, beside how
often its warm-started first round misses the accumulation criterion.

The criterion (``bench/lab/accumulation.py``) compares two single rounds: a run's first round
against the last round of the run whose version it started from, with 2 points' tolerance,
on the device's validation slice.  Where a device's accuracy moves by more than that from
one settled round to the next, the criterion misses some of the time even when nothing was
lost.  This measures that floor from the same lab folders: among the last 10 rounds of each
run that deployed a version (``local_accuracy``, the slice the criterion uses), the share of
pairs of rounds (an earlier, a later) in which the later one is more than the tolerance below
the earlier; and the criterion's misses on the same folders.

Usage: python bench/lab/round_spread.py DIR [DIR ...] > bench/lab/results/accumulation/round_spread.md
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from bench.lab.accumulation import _records, device_rows  # noqa: E402

#: the last rounds of a run counted as settled
LAST = 10


def settled_pairs(accs: list[float], tolerance: float) -> tuple[int, int]:
    """``(pairs below, pairs)``: of the ordered pairs ``i < j`` of ``accs``, how many have
    ``accs[j] < accs[i] - tolerance``."""
    pairs = list(itertools.combinations(accs, 2))
    return sum(1 for a, b in pairs if b < a - tolerance - 1e-9), len(pairs)


def device_spread(lab: Path, tolerance: float) -> dict[str, dict[str, Any]]:
    """Per device of a lab folder: its deploying runs' last-10 accuracies (lists), the pairs
    below and counted, and the criterion's rows and misses (:func:`device_rows`)."""
    out = {}
    for dev in sorted((lab / "devices").iterdir()):
        name, rows = dev.name, device_rows(dev / "state", tolerance)[0]
        lasts = [[round(float(r["local_accuracy"]), 4)
                  for r in _records(dev / "state" / "runs" / row["run"] / "metrics.jsonl")[-LAST:]]
                 for row in rows if row.get("deployed") is not None]
        below = total = 0
        for accs in lasts:
            b, t = settled_pairs(accs, tolerance)
            below, total = below + b, total + t
        judged = [r for r in rows if "ok" in r]
        out[name] = {"last_rounds": lasts, "below": below, "pairs": total, "rows": len(judged),
                     "misses": sum(1 for r in judged if not r["ok"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.02)
    a = ap.parse_args()
    print("`python bench/lab/round_spread.py " + " ".join(d.name for d in a.dirs) + "`\n")
    print(f"Settled rounds: the last {LAST} of each run that deployed a version. A pair: an earlier and a later "
          f"one of them; below: the later more than {a.tolerance * 100:g} points below the earlier.\n")
    print("| device | runs | settled accuracy (mean, range of a run's last 10, mean of runs) | pairs below | "
          "first rounds judged | missed |")
    print("|---|---|---|---|---|---|")
    by: dict[str, list[dict[str, Any]]] = {}
    for lab in a.dirs:
        for name, row in device_spread(lab, a.tolerance).items():
            by.setdefault(name, []).append(row)
    for name, rows in sorted(by.items()):
        lasts = [accs for r in rows for accs in r["last_rounds"] if accs]
        mean = statistics.mean(x for accs in lasts for x in accs)
        spread = statistics.mean(max(accs) - min(accs) for accs in lasts)
        below, pairs = sum(r["below"] for r in rows), sum(r["pairs"] for r in rows)
        judged, missed = sum(r["rows"] for r in rows), sum(r["misses"] for r in rows)
        print(f"| {name} | {len(lasts)} | {mean:.3f}, {spread * 100:.1f} points | {below} of {pairs} "
              f"({100 * below / pairs:.0f} %) | {judged} | {missed} |")


if __name__ == "__main__":
    main()
