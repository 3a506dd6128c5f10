"""Accumulation across runs, from a field-lab output folder (``dflctl lab run ... --out DIR``).

For every training device and every run after its first, in the order the device's run
ledger lists them: the run's first-round accuracy on the device's validation slice (the
round record's ``local_accuracy``, the slice the deploy gate uses) against the validation
accuracy of the version the run started from (its manifest's ``accuracy``, measured by the
deploy gate when that version was deployed, and on this run's own slice, which the gate
measured when it compared this run's candidate: the manifest's ``deployed_accuracy``), and
whether it is at least the latter (else the former) minus ``--tolerance`` (2 points); beside it,
the lowest and highest accuracy of the last 10 rounds of the run that deployed that version
(how much it moved from round to round).  Then, per
device, the version deployed by the last run against the one deployed by the first, both on the
device's final validation slice (its store at the end, ``validation_mask`` share
``--validation-share``; the deploy gate measured each on the slice of its own day, which grew
in between), and the lab's held-out accuracy of each run (report.json).

    python bench/lab/accumulation.py DIR [--json OUT]

Exit code 0 when every check holds, 1 when one fails, 2 when DIR is no lab output folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dfl_agent.runtime.service.ledger import read_entries
from dfl_agent.runtime.service.retention import read_records


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """The round records of a run (``metrics.jsonl``, gzipped once the run ended) that carry
    ``local_accuracy`` (none: no file)."""
    return [r for r in read_records(run_dir) if isinstance(r.get("local_accuracy"), (int, float))]


def _first_round(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round-1 record (None: the run has none)."""
    return next((r for r in records if r.get("round") == 1), None)


def _last_rounds(records: list[dict[str, Any]], n: int = 10) -> list[float]:
    """``local_accuracy`` of the last ``n`` round records."""
    return [float(r["local_accuracy"]) for r in records[-n:]]


def _manifests(state: Path) -> dict[str, dict[str, Any]]:
    """run id -> the manifest of the version it deployed."""
    out = {}
    for m in sorted((state / "models").glob("v*/manifest.json")):
        man = _json(m)
        if isinstance(man, dict) and man.get("run_id"):
            out[str(man["run_id"])] = man
    return out


def final_slice_accuracy(state: Path, versions: list[int], share: float) -> dict[int, float] | None:
    """Each deployed version's accuracy on the device's validation slice as its store holds it
    now (None: no store, or no validation window)."""
    import numpy as np

    from dfl_agent.models.deployed import load_deployed
    from dfl_agent.store.sqlite import SampleStore, StoreError, validation_mask

    try:
        store = SampleStore(state, create=False)
    except StoreError:
        return None
    try:
        sid, x, y, _ = store.load(store.snapshot())
    finally:
        store.close()
    val = validation_mask(sid, share)
    if not val.any():
        return None
    import torch

    out = {}
    for v in versions:
        with torch.no_grad():
            pred = load_deployed(state / "models" / f"v{v}")(torch.from_numpy(x[val])).argmax(1).numpy()
        out[v] = round(float(np.mean(pred == y[val])), 4)
    return out


def device_rows(state: Path, tolerance: float, share: float = 0.2) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-run rows of one device and its first-vs-last summary."""
    entries = read_entries(state)  # runs/ledger.sqlite (an earlier release's runs/ledger.json)
    # in the order they ended (an entry's time is its last change)
    runs = sorted(entries, key=lambda r: float(entries[r].get("time", 0)) if isinstance(entries[r], dict) else 0.0)
    mans = _manifests(state)
    by_version = {int(m["version"]): m for m in mans.values() if isinstance(m.get("version"), int)}
    records = {rid: _records(state / "runs" / rid) for rid in runs}  # each file read once
    rows = []
    for rid in runs:
        first = _first_round(records[rid])
        if first is None:
            continue  # declined or never trained here
        row: dict[str, Any] = {"run": rid, "init": first.get("init"), "first_round_accuracy": first["local_accuracy"],
                               "deployed": mans.get(rid, {}).get("version"),
                               "deployed_accuracy": mans.get(rid, {}).get("accuracy"),
                               "linear_probe": first.get("linear_probe")}  # the warm start's fit, when recorded
        src = mans.get(rid, {}).get("started_from")
        if src is None and first.get("init") == "deployed":
            src = first.get("started_from")
        base = by_version.get(int(src)) if isinstance(src, int) else None
        if base is not None:
            row["started_from"] = int(src)
            row["started_from_accuracy"] = base.get("accuracy")
            # the same version on this run's own validation slice (the store grew since it was
            # deployed): the deploy gate measured it when it compared this run's candidate
            same_slice = mans.get(rid, {}).get("deployed_accuracy")
            row["started_from_on_this_slice"] = same_slice
            # how much the accuracy moved from round to round at the end of the run that deployed it
            last = _last_rounds(records.get(str(base.get("run_id")), []))
            row["started_from_run_last_10"] = [min(last), max(last)] if last else None
            ref = float(same_slice if isinstance(same_slice, (int, float)) else base.get("accuracy", 0.0))
            row["ok"] = row["first_round_accuracy"] >= ref - tolerance
        rows.append(row)
    deployed = [r for r in rows if r["deployed_accuracy"] is not None]
    summary = {"first_deployed": deployed[0]["deployed_accuracy"] if deployed else None,
               "last_deployed": deployed[-1]["deployed_accuracy"] if deployed else None,
               "run_count": len(rows)}
    if len(deployed) >= 2:
        first, last = deployed[0]["deployed_accuracy"], deployed[-1]["deployed_accuracy"]
        final = final_slice_accuracy(state, [deployed[0]["deployed"], deployed[-1]["deployed"]], share)
        if final is not None:  # both on the same slice: the final one
            first, last = final[deployed[0]["deployed"]], final[deployed[-1]["deployed"]]
            summary.update(first_on_final_slice=first, last_on_final_slice=last)
        # a slice on which the first version was already right everywhere cannot be beaten
        summary["beats_first"] = "saturated" if first == last == 1.0 else last > first
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the lab's --out folder")
    ap.add_argument("--tolerance", type=float, default=0.02, help="first-round accuracy may be this much lower")
    ap.add_argument("--validation-share", type=float, default=0.2, help="the agents' data.validation_share")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    devices = sorted(p for p in (a.dir / "devices").glob("*") if any((p / "state" / "runs" / n).exists()
                                                                      for n in ("ledger.sqlite", "ledger.json")))
    if not devices:
        print(f"accumulation: {a.dir} has no devices/*/state/runs/ledger.sqlite (no lab output folder)",
              file=sys.stderr)
        return 2
    out: dict[str, Any] = {"tolerance": a.tolerance, "devices": {}}
    ok = True
    print("| device | run | init | started from (accuracy when deployed) | the same on this run's slice "
          "| its run's last 10 rounds | first-round accuracy | ok | deployed (accuracy) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dev in devices:
        rows, summary = device_rows(dev / "state", a.tolerance, a.validation_share)
        out["devices"][dev.name] = {**summary, "runs": rows}
        for r in rows:
            src = f"v{r['started_from']} ({r['started_from_accuracy']:.4f})" if "started_from" in r else "-"
            dep = f"v{r['deployed']} ({r['deployed_accuracy']:.4f})" if r["deployed"] is not None else "kept"
            same = r.get("started_from_on_this_slice")
            same_s = f"{same:.4f}" if isinstance(same, (int, float)) else "-"
            spread = r.get("started_from_run_last_10")
            spread_s = f"{spread[0]:.4f}-{spread[1]:.4f}" if spread else "-"
            print(f"| {dev.name} | {r['run']} | {r['init']} | {src} | {same_s} | {spread_s} | "
                  f"{r['first_round_accuracy']:.4f} | "
                  f"{'yes' if r.get('ok', True) else 'NO'} | {dep} |")
            ok &= bool(r.get("ok", True))
        ok &= summary.get("beats_first", True) in (True, "saturated")
    print()
    print("| device | deployed accuracy after the first run | after the last | the two on the final slice "
          "| beats the first |")
    print("|---|---|---|---|---|")
    for name, d in out["devices"].items():
        final = (f"{d['first_on_final_slice']:.4f} -> {d['last_on_final_slice']:.4f}"
                 if "first_on_final_slice" in d else "-")
        print(f"| {name} | {d['first_deployed']} | {d['last_deployed']} | {final} | {d.get('beats_first', '-')} |")
    report = a.dir / "report.json"
    if report.exists():
        runs = _json(report).get("runs", [])
        out["held_out"] = {r["run_id"]: r.get("final_accuracy_mean") for r in runs if isinstance(r, dict)}
        print("\nHeld-out users (the lab's accuracy), per run in submission order: "
              + ", ".join(f"{rid} {acc}" for rid, acc in out["held_out"].items()))
    out["passed"] = ok
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"\naccumulation: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
