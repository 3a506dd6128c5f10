"""Local training that diverged, and the re-joins that followed, from a field-lab output folder.

For every device of ``dflctl lab run ... --out DIR``: the rounds whose record says
``cold_start: "diverged"`` (its local training diverged and it took its neighbours' mean
instead of its own model), with the training loss of the two rounds before and the accuracy
on its validation slice before and after; the devices that left it out of their average
(``cold_excluded``); and its last round's accuracy and training loss.

    python bench/lab/rejoins.py DIR [DIR ...] [--json OUT]

Exit code 0, or 2 when a DIR is no lab output folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def device_rejoins(metrics: Path) -> dict[str, Any]:
    """The re-joins of one device's run (its ``metrics.jsonl``)."""
    recs = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    recs = [r for r in recs if isinstance(r, dict) and "round" in r]
    out = []
    for i, r in enumerate(recs):
        if r.get("cold_start") == "diverged":
            before = recs[max(0, i - 2):i]
            out.append({"round": r["round"], "loss_before": [b.get("train_loss") for b in before],
                        "accuracy_before": before[-1].get("global_accuracy") if before else None,
                        "accuracy_after": r.get("global_accuracy"), "adopted_from": r.get("neighbour_ids")})
    last = recs[-1] if recs else {}
    return {"rounds": len(recs), "diverged": last.get("diverged"), "rejoins": out,
            "excluded_by_it": sorted({s for r in recs for s in r.get("cold_excluded", [])}),
            "last_round": last.get("round"), "last_accuracy": last.get("global_accuracy"),
            "last_train_loss": last.get("train_loss"), "last_neighbours": last.get("neighbours")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", type=Path, nargs="+", help="the lab's --out folders")
    ap.add_argument("--json", type=Path, help="also write the result as JSON here")
    a = ap.parse_args(argv)
    result: dict[str, Any] = {}
    print("| run | device | rounds | diverged | re-joined in round (loss of the two rounds before; accuracy before "
          "-> after) | left out by it | last round: accuracy, loss, neighbours |")
    print("|---|---|---|---|---|---|---|")
    for d in a.dirs:
        files = sorted(d.glob("devices/*/state/runs/*/metrics.jsonl"))
        if not files:
            print(f"rejoins: {d} has no devices/*/state/runs/*/metrics.jsonl (no lab output folder)", file=sys.stderr)
            return 2
        for f in files:
            dev = f.parts[-5]
            info = device_rejoins(f)
            result.setdefault(d.name, {})[dev] = info
            joins = "; ".join(f"{j['round']} ({', '.join(f'{x:.3g}' for x in j['loss_before'] if x is not None)}; "
                              f"{j['accuracy_before']:.2f} -> {j['accuracy_after']:.2f})" for j in info["rejoins"]) or "-"
            loss = info["last_train_loss"]
            print(f"| {d.name} | {dev} | {info['rounds']} | {info['diverged']} | {joins} | "
                  f"{', '.join(info['excluded_by_it']) or '-'} | {info['last_accuracy']:.2f}, "
                  f"{'-' if loss is None else f'{loss:.3g}'}, {info['last_neighbours']} |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
