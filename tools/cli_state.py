"""``dflctl state check|recover``: the agent's state directory, checked, and a damaged run ledger
rebuilt (torch-free).

``dflctl state check --state-dir S``
    checks every state file as the agent does at start (the run ledger, node id, sample store,
    members, checkpoints, deployed models), repairing nothing; prints one line per damaged file and
    what the agent does about it, the directory's size and the free space under it.  Exit code 0
    when nothing is damaged, 1 otherwise.
``dflctl state recover --state-dir S``
    for a damaged run ledger only (the agent refuses to start on one): moves its files to
    ``runs/damaged-TIME/`` and writes a new ledger from the rows that still read and the run
    folders, every run found there recorded as ended (none of them runs again).  Stop the agent
    first.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from types import SimpleNamespace
from typing import Any

from dfl_agent.cli.cli_data import resolve, state_dir_args


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def cmd_check(a: argparse.Namespace) -> int:
    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.service.retention import free_space, usage
    from dfl_agent.runtime.service.state_files import check_state
    from dfl_agent.runtime.shared.assembly import StartupError

    sd, cfg = resolve(a)
    if not sd.is_dir():
        raise ValueError(f"no state directory at {sd}")
    problems: list[dict[str, str]] = []
    ledger = None
    try:
        ledger = RunLedger(sd)
    except StartupError as exc:
        problems.append({"file": str(sd / "runs" / "ledger.sqlite"), "line": str(exc), "refuses_start": "yes"})
    try:
        for f in check_state(cfg or SimpleNamespace(state_dir=str(sd), node_id=None), ledger, fix=False):
            problems.append({"file": str(f.path), "line": f.line, "refuses_start": "no"})
    except StartupError as exc:
        problems.append({"file": "", "line": str(exc), "refuses_start": "yes"})
    finally:
        if ledger is not None:
            ledger.close()
    use = usage(sd)
    free, total, _where = free_space(sd)
    doc: dict[str, Any] = {"schema_version": 1, "state_dir": str(sd), "ok": not problems, "problems": problems,
                           "bytes": use, "free_bytes": free, "disk_bytes": total}
    if a.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        for p in problems:
            print(("refuses to start: " if p["refuses_start"] == "yes" else "") + p["line"])
        parts = ", ".join(f"{k} {_size(v)}" for k, v in use.items() if k != "total" and v)
        print(f"state directory {sd}: {'ok' if not problems else f'{len(problems)} damaged'}; {_size(use['total'])}"
              f"{f' ({parts})' if parts else ''}; {_size(free)} free of {_size(total)}")
    return 0 if not problems else 1


def cmd_recover(a: argparse.Namespace) -> int:
    from dfl_agent.runtime.service.ledger_recovery import recover

    sd, _cfg = resolve(a)
    try:
        res = recover(sd)
    except (sqlite3.Error, OSError) as exc:
        raise ValueError(f"run ledger {sd / 'runs' / 'ledger.sqlite'}: cannot be recovered ({exc})") from None
    if a.json:
        print(json.dumps({"schema_version": 1, **res}, indent=2, sort_keys=True))
        return 0
    states = ", ".join(f"{n} {s}" for s, n in sorted(res["states"].items())) or "none"
    print(f"run ledger {sd / 'runs' / 'ledger.sqlite'}: rebuilt with {res['runs']} runs ({states}): "
          f"{res['from_ledger']} from the rows of the damaged ledger that still read, {res['from_folders']} from run "
          f"folders; {res['cancelled']} cancel records")
    if res["unreadable_rows"]:
        print(f"{res['unreadable_rows']} rows of the damaged ledger did not read: a run among them that left no "
              "folder could be admitted again if its descriptor is still retained on the broker")
    print(f"the damaged files are kept in {res['moved_to']}; start the agent again")
    return 0


def register(sub: Any) -> None:
    """Add ``dflctl state`` to the dflctl sub-parsers."""
    p = sub.add_parser("state", help="the agent's state directory: check every state file, rebuild a damaged run "
                                     "ledger")
    ps = p.add_subparsers(dest="state_cmd", required=True)
    c = ps.add_parser("check", help="check every state file as the agent does at start, repairing nothing (an earlier "
                                    "release's run ledger is taken over, as the agent's start does); exit code 1 "
                                    "when one is damaged")
    state_dir_args(c)
    c.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    c.set_defaults(func=cmd_check)
    r = ps.add_parser("recover", help="rebuild a damaged run ledger from the rows that still read and the run "
                                      "folders, every run found recorded as ended (stop the agent first)")
    state_dir_args(r)
    r.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    r.set_defaults(func=cmd_recover)
