"""Round share: how much of the wall time between two rounds the federated round takes.

Starts mosquitto and ``--nodes`` ``dfl-agent run --once`` daemons configured like the
fedavg demo (``dflctl demo --algorithm fedavg``: HAR by user, one training thread per
agent) but with the local-only baseline off, waits until they finish, and reads every
agent's round records (``metrics.jsonl``).

For each agent and round t >= 2:

* *between rounds*: ``wall[t] - wall[t-1]`` (the time from one round record to the next);
* *federated round*: ``round_wall_s[t]`` (training, encoding, sending, receiving, waiting
  for peers and aggregating; the record also splits it into ``train_s``, ``encode_s``,
  ``send_s``, ``receive_s``, ``wait_s``);
* the share is the sum of federated rounds over the sum of the time between rounds.

Round 1 is reported apart (start-up work): the time from the agent's start to its first
round (``wall[1] - round_wall_s[1]``) and round 1's own ``round_wall_s`` and ``train_s``
against the median of the later rounds.

    nice -n 10 python bench/operations/round_share.py --label after --out bench/operations/round_share.jsonl
    python bench/operations/round_share.py --report bench/operations/round_share.jsonl > bench/operations/round_share.md

The record keeps the command exactly as it was run (the interpreter, the arguments, and
``nice -n N`` only when the process ran niced).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def invocation(argv: list[str] | None = None, executable: str | None = None) -> str:
    """The command line of this process as it was run: ``nice -n N`` when it runs niced
    (``os.nice(0)``), the interpreter (relative to the working directory when inside it)
    and ``argv`` (default ``sys.argv``), shell-quoted."""
    exe = executable or sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
        exe = rel if not rel.startswith("..") else exe
    except ValueError:
        pass
    niceness = os.nice(0)
    return ((f"nice -n {niceness} " if niceness > 0 else "")
            + shlex.join([exe, *(sys.argv if argv is None else argv)]))


def run(nodes: int, rounds: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Run the federation; returns per-agent records (lists of dicts)."""
    from dfl_agent.cli.broker import start_broker
    from dfl_agent.cli.demo import DemoOptions, _config, stop_processes
    from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

    tmp = Path(tempfile.mkdtemp(prefix="dfl-share-"))
    opts = DemoOptions(nodes=nodes, rounds=rounds, algorithm="fedavg")
    ids = [f"n{i}" for i in range(nodes)]
    procs = []
    with start_broker("mosquitto") as broker:
        for i, nid in enumerate(ids):
            cfg = _config(opts, "share", nid, i, broker.endpoint, tmp)
            cfg.runtime.baseline_local = False
            cfg.discovery.mdns = False
            for section, values in extra.items():
                for name, value in values.items():
                    setattr(getattr(cfg, section), name, value)
            path = tmp / f"{nid}.toml"
            text = dump_toml(cfg)
            config_from_dict(__import__("tomllib").loads(text))  # the keys exist and validate
            path.write_text(text, encoding="utf-8")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                stdout=open(tmp / f"{nid}.log", "w"), stderr=subprocess.STDOUT))
        t0 = time.monotonic()
        try:
            for p in procs:
                p.wait(timeout=1800)
        finally:
            stop_processes(procs)
    codes = [p.returncode for p in procs]
    records = {}
    for nid in ids:
        f = tmp / "nodes" / nid / "metrics.jsonl"
        records[nid] = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
    return {"records": records, "exit_codes": codes, "wall_s": time.monotonic() - t0, "dir": str(tmp)}


def summarise(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Share of the federated round in the time between rounds, per agent and overall."""
    per: dict[str, Any] = {}
    fed_total = between_total = 0.0
    parts = {k: 0.0 for k in ("train_s", "encode_s", "send_s", "receive_s", "wait_s")}
    eval_total = 0.0
    for nid, recs in records.items():
        recs = sorted((r for r in recs if "round_wall_s" in r), key=lambda r: r["round"])
        if len(recs) < 3:
            continue
        fed = sum(r["round_wall_s"] for r in recs[1:])
        between = recs[-1]["wall"] - recs[0]["wall"]
        later = recs[1:]
        per[nid] = {
            "rounds": len(recs), "share": fed / between if between else None,
            "startup_before_round1_s": recs[0]["wall"] - recs[0]["round_wall_s"],
            "round1_wall_s": recs[0]["round_wall_s"], "round1_train_s": recs[0].get("train_s"),
            "later_round_wall_median_s": statistics.median(r["round_wall_s"] for r in later),
            "later_train_median_s": statistics.median(r.get("train_s", 0.0) for r in later),
            "eval_s_median": statistics.median(r.get("eval_s", 0.0) for r in later),
            "between_median_s": statistics.median(b["wall"] - a["wall"] for a, b in zip(recs, recs[1:])),
        }
        fed_total += fed
        between_total += between
        for k in parts:
            parts[k] += sum(r.get(k, 0.0) for r in later)
        eval_total += sum(r.get("eval_s", 0.0) for r in later)
    return {"share": fed_total / between_total if between_total else None, "per_node": per,
            "breakdown_of_between_rounds": {**{k: v / between_total for k, v in parts.items()},
                                            "eval_s (may overlap the next round)": eval_total / between_total}
            if between_total else {}}


def report(path: Path) -> str:
    lines = ["# Round share: federated round / wall time between rounds (4 fedavg daemons)", ""]
    for line in path.read_text().splitlines():
        r = json.loads(line)
        s = r["summary"]
        lines += [f"## {r['label']} ({r['time']})", "", f"Command: `{r['command']}`", "",
                  f"Federated-round share of the time between rounds: **{100 * s['share']:.0f} %** "
                  f"(exit codes {r['exit_codes']}, run wall {r['wall_s']:.0f} s)", "",
                  "Share of the time between rounds, by part:", "",
                  "| part | share |", "|---|---|"]
        for k, v in s["breakdown_of_between_rounds"].items():
            lines.append(f"| {k} | {100 * v:.1f} % |")
        lines += ["", "| node | share | between rounds (median s) | round wall (median s) | train (median s) | "
                  "eval (median s) | start-up before round 1 (s) | round 1 wall (s) | round 1 train (s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for nid, p in s["per_node"].items():
            lines.append(f"| {nid} | {100 * p['share']:.0f} % | {p['between_median_s']:.2f} | "
                         f"{p['later_round_wall_median_s']:.2f} | {p['later_train_median_s']:.2f} | "
                         f"{p['eval_s_median']:.2f} | {p['startup_before_round1_s']:.1f} | {p['round1_wall_s']:.2f} | "
                         f"{p['round1_train_s']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4, help="daemons")
    p.add_argument("--rounds", type=int, default=8, help="rounds")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=JSON",
                   help="extra config value for every agent, e.g. runtime.eval_every=5")
    p.add_argument("--label", default="run", help="name of this run in the results file")
    p.add_argument("--out", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--report", default=None, help="print the Markdown report of a results file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    extra: dict[str, Any] = {}
    for item in a.set:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        extra.setdefault(section, {})[name] = json.loads(value)
    res = run(a.nodes, a.rounds, extra)
    rec = {"label": a.label, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": invocation(),
           "exit_codes": res["exit_codes"], "wall_s": res["wall_s"], "summary": summarise(res["records"]),
           "records": res["records"]}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "records"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
