"""``dflctl lab``: the field lab (an emulated site network on this host, as root).

``check`` says which capabilities work here; ``down`` removes what a killed lab left
behind (exactly the objects its state file lists). The lab's code is in
:mod:`dfl_agent.cli.lab`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def cmd_lab_check(args: argparse.Namespace) -> int:
    from dfl_agent.cli.lab import check

    return check.main()


def cmd_lab_down(args: argparse.Namespace) -> int:
    from dfl_agent.cli.lab import check, state

    why = check.blocker()
    if why:
        print(f"dflctl lab: cannot run here: {why}", file=sys.stderr)
        return 2
    files = state.read_states()
    if not files:
        print(f"no lab state files in {state.state_dir()}: nothing to remove")
        return 0
    for path, doc in files:
        run_id = doc.get("run_id", path.stem)
        pid = doc.get("pid")
        if not args.force and isinstance(pid, int) and state.alive(pid, doc.get("pid_start")):
            print(f"lab {run_id}: still running (process {pid}); left alone (--force removes it)")
            continue
        removed = state.teardown(doc)
        path.unlink(missing_ok=True)
        print(f"lab {run_id}: removed {len(removed)} object(s)" + "".join(f"\n  {r}" for r in removed))
    return 0


def cmd_lab_run(args: argparse.Namespace) -> int:
    """``lab run SCENARIO --out DIR``: exit 0 when every check passes, 1 naming the
    failures, 2 for a scenario that cannot run (the key named) or a host that cannot."""
    from pathlib import Path

    from dfl_agent.cli.lab import check
    from dfl_agent.cli.lab.scenario import ScenarioError, load

    releases = {}
    for item in args.release or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"dflctl lab run: --release {item}: NAME=PATH (a wheel or a release folder)", file=sys.stderr)
            return 2
        releases[name] = path
    try:
        scenario = load(args.scenario, perfect=args.perfect, releases=releases)
    except ScenarioError as e:
        print(f"dflctl lab run: bad scenario: {args.scenario}: {e}", file=sys.stderr)
        return 2
    why = check.blocker()
    if why:
        print(f"dflctl lab: cannot run here: {why}", file=sys.stderr)
        return 2
    from dfl_agent.cli.broker import mosquitto_path
    from dfl_agent.cli.lab.runner import LabRun

    if mosquitto_path() is None:
        print("dflctl lab: cannot run here: mosquitto is not installed (apt install mosquitto)", file=sys.stderr)
        return 2
    from dfl_agent.cli.lab.net import LabError

    out = Path(args.out).resolve()
    try:
        report = LabRun(scenario, out).run()
    except (LabError, RuntimeError, OSError, ValueError) as e:  # torn down already; say why in one line
        print(f"dflctl lab run: the lab failed: {e}", file=sys.stderr)
        return 1
    print(f"report: {out / 'report.json'} and {out / 'report.md'}")
    if report["passed"]:
        print(f"{scenario.name}: every check passed")
        return 0
    print(f"{scenario.name}: {len(report['failed_checks'])} check(s) failed:", file=sys.stderr)
    for f in report["failed_checks"]:
        print(f"  {f}", file=sys.stderr)
    return 1


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``lab check``, ``lab run`` and ``lab down`` to dflctl's sub-parsers."""
    lab = sub.add_parser("lab", help="the field lab: an emulated site network on this host (Linux, root)")
    lsub = lab.add_subparsers(dest="lab_cmd", required=True, metavar="LAB_COMMAND", title="lab commands")
    c = lsub.add_parser("check", help="which capabilities the lab can use here (exit 2: it cannot run)")
    c.set_defaults(func=cmd_lab_check)
    r = lsub.add_parser("run", help="run a scenario: build its network, run the agents and events, write the "
                                    "report (exit 1: a check failed)")
    r.add_argument("scenario", metavar="SCENARIO.toml", help="the scenario file (tools/lab/scenarios/ has some)")
    r.add_argument("--out", required=True, metavar="DIR", help="folder for the report, logs and metrics")
    r.add_argument("--perfect", action="store_true",
                   help="run the scenario as if it said perfect = true: no limits, no loss, no events (the comparison)")
    r.add_argument("--release", action="append", metavar="NAME=PATH",
                   help="a release of the scenario's [releases]: a wheel of dfl-agent or a folder holding its "
                        "dfl_agent package (replaces the file's; repeat for more)")
    r.set_defaults(func=cmd_lab_run)
    d = lsub.add_parser("down", help="remove what a killed lab left behind (only what its state files list)")
    d.add_argument("--force", action="store_true", help="also remove labs whose builder process still runs")
    d.set_defaults(func=cmd_lab_down)
