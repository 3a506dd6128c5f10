"""``dflctl lab``: the field lab (an emulated site network on this host, as root).

``check`` says which capabilities work here; ``down`` removes what a killed lab left
behind (exactly the objects its state file lists). The lab's code is in
:mod:`dfl_agent.cli.lab`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


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


def register(sub: Any) -> None:
    """Add ``lab check`` and ``lab down`` to dflctl's sub-parsers."""
    lab = sub.add_parser("lab", help="the field lab: an emulated site network on this host (Linux, root)")
    lsub = lab.add_subparsers(dest="lab_cmd", required=True, metavar="LAB_COMMAND", title="lab commands")
    c = lsub.add_parser("check", help="which capabilities the lab can use here (exit 2: it cannot run)")
    c.set_defaults(func=cmd_lab_check)
    d = lsub.add_parser("down", help="remove what a killed lab left behind (only what its state files list)")
    d.add_argument("--force", action="store_true", help="also remove labs whose builder process still runs")
    d.set_defaults(func=cmd_lab_down)
