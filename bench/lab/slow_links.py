"""Slow links: how long a federation on shaped links takes to reach 65 % held-out accuracy,
with and without the agent's default compression.

One field-lab scenario per cell (``scenarios/slow-<rate>-<compression>.toml``): three
training devices on one site, each with half a core and a link of 0.5, 2 or 10 Mbit/s
(``tbf``, both directions), each holding all of one HAR user's windows from the start;
one ``fedavg`` run of 30 rounds with the widest model of the H2 family (``[model] family
= "H2"``, ``size = "large"``: 234k parameters, 0.94 MB as float32), compression ``none``
or the agent's shipped default (``lab_compression()``), each agent told its link rate
(``mqtt.link_rate``, as docs/how-to/slow-links.md says: the round deadline and the MQTT
chunks follow it), no events; the scenario stops after 210 s. The lab measures every round's model
on HAR's held-out test users (report.json's ``accuracy_curve``).

Per cell (``results/slow_links.{json,md}``):

- **time to 65 %**: seconds from the run's submission until the devices' mean round-model
  accuracy first reaches 0.65 (``time_to_accuracy``); if it never does, "never" and the
  best mean reached;
- **bytes**: what the agents sent (their own count, payload: ``bytes_total``), per round,
  and on the wire (the devices' links, both directions, Ethernet frames with TLS, TCP/IP,
  status and mDNS); the **factor** is bytes sent per round without compression divided by
  this cell's, at the same rate;
- **the split** of the rounds' time up to the target round (all rounds when it is never
  reached), per device and averaged over the devices, from the round records
  (``metrics.jsonl``): *start-up* (submission to the first round's start), *training*
  (``train_s``), *transfer* (the time the link needs for the round's payload at its rate:
  ``max(round_bytes_sent, round_bytes_received) * 8 / rate`` — upload and download use the
  link's two directions at once — capped at the round's time not spent training), and
  *waiting* (the rest: peers still training or sending, deadlines, encoding, decoding,
  aggregation).

Usage (from the repository root; the lab needs root; each cell takes 2 to 5 minutes here,
all six under 30):

    sudo nice -n 5 .venv/bin/python bench/lab/slow_links.py --run             # all six cells
    sudo nice -n 5 .venv/bin/python bench/lab/slow_links.py --run --only 10mbit-auto
    .venv/bin/python bench/lab/slow_links.py                                   # the scenario files only
    .venv/bin/python bench/lab/slow_links.py --report                          # the tables again

Each cell's lab output goes to ``--work`` (default ``/tmp/dfl-slow-links/<cell>``); a rerun
replaces the cell's row in ``results/slow_links.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios"
RESULTS = HERE / "results" / "slow_links.json"
REPORT = HERE / "results" / "slow_links.md"
RATES = ("500kbit", "2mbit", "10mbit")
TARGET = 0.65
ROUNDS = 30
DURATION_S = 210

SCENARIO = """\
# Slow links: {rate} links, compression {spec} (written by bench/lab/slow_links.py).
# sudo dflctl lab run bench/lab/scenarios/{name}.toml --out DIR
[lab]
duration_s = {duration}
seed = 0
dataset = "har"
initial_windows = 400

[[site]]
name = "a"

[[class]]
name = "dev"
cpu = 0.5
memory_mb = 1024
rate = "{rate}"
profile = "generic-x86"

[[device]]
class = "dev"
site = "a"
count = 3

[[run]]
at_s = 1
algorithm = "fedavg"
rounds = {rounds}

[agent]
model = {{ family = "H2", size = "large" }}
compression = {{ spec = "{spec}", error_feedback = true }}
training = {{ epochs = 2 }}
mqtt = {{ link_rate = "{rate}" }}
"""


def default_spec() -> str:
    """The compression the lab's agents run with by default (the agent's shipped default)."""
    from dfl_agent.cli.lab.runner import lab_compression

    return lab_compression()


def cells(default: str | None = None) -> list[tuple[str, str, str]]:
    """``(name, rate, spec)`` of every cell: each rate without compression and with the default."""
    default = default or default_spec()
    out = []
    for rate in RATES:
        for spec in ("none", default):
            out.append((f"slow-{rate}-{re.sub(r'[^a-z0-9.]+', '_', spec.lower())}", rate, spec))
    return out


def write_scenarios() -> list[Path]:
    SCENARIOS.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rate, spec in cells():
        p = SCENARIOS / f"{name}.toml"
        p.write_text(SCENARIO.format(name=name, rate=rate, spec=spec, rounds=ROUNDS, duration=DURATION_S))
        paths.append(p)
    return paths


def _split(recs: list[dict[str, Any]], upto: int | None, rate_bps: float, submitted: float) -> dict[str, float]:
    """One device's time split for the rounds up to ``upto`` (all when None), from its
    round records; ``submitted`` on the records' clock (seconds since the agents started + t0)."""
    rounds = sorted((r for r in recs if isinstance(r.get("round"), int) and "round_wall_s" in r),
                    key=lambda r: r["round"])
    if upto is not None:
        rounds = [r for r in rounds if r["round"] <= upto]
    if not rounds:
        return {"startup_s": 0.0, "training_s": 0.0, "transfer_s": 0.0, "waiting_s": 0.0}
    first = rounds[0]
    startup = max(0.0, first["time"] - first["round_wall_s"] - submitted)
    train = transfer = wait = 0.0
    for r in rounds:
        wall, tr = float(r["round_wall_s"]), float(r.get("train_s", 0.0))
        payload = max(int(r.get("round_bytes_sent", 0)), int(r.get("round_bytes_received", 0)))
        link = min(max(0.0, wall - tr), payload * 8 / rate_bps)
        train, transfer, wait = train + tr, transfer + link, wait + max(0.0, wall - tr - link)
    return {"startup_s": startup, "training_s": train, "transfer_s": transfer, "waiting_s": wait}


def row(rep: dict[str, Any], recs: dict[str, list[dict[str, Any]]], t0: float, rate: str, spec: str,
        name: str) -> dict[str, Any]:
    """The cell's row from its report.json and its devices' round records
    (``{device: [record, ...]}``; ``t0`` = the records' clock at the agents' start)."""
    from dfl_agent.cli.lab.net import parse_rate

    run = rep["runs"][0] if rep.get("runs") else {}
    tta = run.get("time_to_accuracy") or {"target": TARGET, "seconds": None, "round": None, "best": None}
    devices = [d["id"] for d in rep.get("devices", []) if d.get("role", "train") == "train"]
    rounds = max((len(rs) for rs in recs.values()), default=0)
    submitted = t0 + float(run.get("submitted_s") or 0.0)
    splits = [_split(recs.get(n, []), tta.get("round"), parse_rate(rate), submitted) for n in devices]
    split = {k: round(sum(s[k] for s in splits) / len(splits), 1) if splits else None
             for k in ("startup_s", "training_s", "transfer_s", "waiting_s")}
    links = rep.get("links") or {}
    wire = sum(links[n]["bytes_to_host"] + links[n]["bytes_from_host"] for n in devices if n in links)
    sent = int(rep.get("bytes_total") or 0)
    return {"cell": name, "rate": rate, "compression": spec, "rounds": rounds, "state": run.get("state"),
            "time_to_accuracy": tta, "bytes_sent": sent, "bytes_sent_per_round": round(sent / rounds) if rounds else None,
            "wire_bytes": wire, "split": split, "accuracy_curve": run.get("accuracy_curve", []),
            "wall_seconds": rep.get("wall_seconds"), "passed_scenario": rep.get("passed")}


def with_factors(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's ``factor``: bytes sent per round without compression / this row's, at the
    same rate; and its ``speedup``: the time to 65 % without compression / this row's (None
    where either never reached it)."""
    base = {r["rate"]: r["bytes_sent_per_round"] for r in rows if r["compression"] == "none"}
    base_t = {r["rate"]: r["time_to_accuracy"].get("seconds") for r in rows if r["compression"] == "none"}
    for r in rows:
        b, mine = base.get(r["rate"]), r["bytes_sent_per_round"]
        r["factor"] = round(b / mine, 1) if b and mine else None
        bt, t = base_t.get(r["rate"]), r["time_to_accuracy"].get("seconds")
        r["speedup"] = round(bt / t, 1) if bt and t else None
    return rows


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``results/slow_links.md``."""
    lines = ["# Slow links: time to 65 % held-out accuracy", "",
             f"Measured with `{meta.get('command', '')}` on {meta.get('host', '?')} ({meta.get('date', '?')}"
             + (f", commit {meta['commit']}" if meta.get("commit") else "") + "). "
             "Definitions: bench/lab/slow_links.py. *faster*: time to 65 % without compression / this cell's; "
             "*fewer bytes*: bytes sent per round without compression / this cell's (same rate).", "",
             "| rate | compression | rounds | time to 65 % (s) | faster | MB sent | kB sent / round | fewer bytes "
             "| MB on the wire | start-up s | training s | transfer s | waiting s |", "|" + "---|" * 13]
    order = {r: i for i, r in enumerate(RATES)}
    for r in sorted(rows, key=lambda r: (order.get(r["rate"], 99), r["compression"] != "none")):
        tta = r["time_to_accuracy"]
        reached = (f"{tta['seconds']:.0f} (round {tta['round']})" if tta.get("seconds") is not None
                   else f"never (best {tta['best']:.3f})" if tta.get("best") is not None else "no measurement")
        s = r["split"]
        per_round = "-" if r["bytes_sent_per_round"] is None else f"{r['bytes_sent_per_round'] / 1e3:.0f}"
        factor = "-" if r.get("factor") is None else f"{r['factor']}x"
        faster = "-" if r.get("speedup") is None else f"{r['speedup']}x"
        lines.append(f"| {r['rate']} | {r['compression']} | {r['rounds']} | {reached} | {faster} | {_mb(r['bytes_sent'])} "
                     f"| {per_round} | {factor} | {_mb(r['wire_bytes'])} | {s['startup_s']} | {s['training_s']} "
                     f"| {s['transfer_s']} | {s['waiting_s']} |")
    return "\n".join(lines) + "\n"


def _records(out: Path) -> dict[str, list[dict[str, Any]]]:
    recs: dict[str, list[dict[str, Any]]] = {}
    for m in sorted((out / "metrics").glob("*/*.jsonl")):
        for line in m.read_text().splitlines():
            try:
                recs.setdefault(m.parent.name, []).append(json.loads(line))
            except ValueError:
                continue
    return recs


def _t0(rep: dict[str, Any], recs: dict[str, list[dict[str, Any]]]) -> float:
    """The records' clock at the agents' start, from a device's round_accuracy (t_s) and
    the same round's record time."""
    for d in rep.get("devices", []):
        for t_s, rnd, _ in d.get("round_accuracy") or []:
            for r in recs.get(d["id"], []):
                if r.get("round") == rnd and "time" in r:
                    return float(r["time"]) - float(t_s)
    return 0.0


def run_cell(name: str, rate: str, spec: str, work: Path) -> dict[str, Any]:
    out = work / name
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "dfl_agent.cli.dflctl", "lab", "run", str(SCENARIOS / f"{name}.toml"),
           "--out", str(out)]
    print(f"{name}: {' '.join(cmd)}", flush=True)
    t = time.monotonic()
    r = subprocess.run(cmd, text=True, check=False)
    if not (out / "report.json").exists():
        raise SystemExit(f"{name}: the lab wrote no report (exit {r.returncode})")
    rep = json.loads((out / "report.json").read_text())
    recs = _records(out)
    res = row(rep, recs, _t0(rep, recs), rate, spec, name)
    print(f"{name}: {time.monotonic() - t:.0f} s, time to 65 %: {res['time_to_accuracy']}", flush=True)
    return res


def _commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout."""
    import subprocess

    r = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       check=False)
    return r.stdout.strip() or None if r.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--run", action="store_true", help="run the cells with dflctl lab run (as root)")
    ap.add_argument("--only", action="append", default=[], metavar="CELL",
                    help="run only this cell (e.g. 10mbit-auto; repeatable)")
    ap.add_argument("--report", action="store_true", help="write results/slow_links.md from the JSON")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dfl-slow-links"), help="the labs' output folders")
    a = ap.parse_args(argv)
    write_scenarios()
    doc: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"meta": {}, "rows": []}
    if a.run:
        todo = [c for c in cells() if not a.only or any(c[0].endswith(o) for o in a.only)]
        if not todo:
            raise SystemExit(f"no cell matches {a.only}; cells: {', '.join(c[0] for c in cells())}")
        for name, rate, spec in todo:
            res = run_cell(name, rate, spec, a.work)
            doc["rows"] = [r for r in doc["rows"] if r["cell"] != name] + [res]
            doc["meta"] = {"command": "sudo nice -n 5 .venv/bin/python bench/lab/slow_links.py --run"
                           + "".join(f" --only {o}" for o in a.only),
                           "host": f"{platform.machine()}, {os.cpu_count()} cores",
                           "commit": _commit(),
                           "date": time.strftime("%Y-%m-%d")}
            doc["rows"] = with_factors(doc["rows"])
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    if a.run or a.report:
        if not doc["rows"]:
            raise SystemExit(f"no results in {RESULTS}: run with --run first")
        REPORT.write_text(render(with_factors(doc["rows"]), doc["meta"]))
        print(REPORT.read_text())
    else:
        print(f"scenarios in {SCENARIOS}: {', '.join(c[0] for c in cells())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
