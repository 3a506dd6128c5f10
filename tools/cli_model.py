"""``dflctl model show|rollback|deploy``: the deployed model versions (torch-free)."""

from __future__ import annotations

import argparse
import datetime
import json
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.cli_data import resolve, state_dir_args

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def _models(a: argparse.Namespace) -> Any:
    from dfl_agent.deploy import ModelStore

    sd, cfg = resolve(a)
    return ModelStore(sd, keep=cfg.deploy.keep if cfg else 3)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def cmd_show(a: argparse.Namespace) -> int:
    models = _models(a)
    doc = models.show()
    if a.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    if not doc["versions"]:
        print(f"no model deployed under {models.root}")
    for e in doc["versions"]:
        when = datetime.datetime.fromtimestamp(e["time"] or 0, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        print(f"{'*' if e['current'] else ' '} v{e['version']}  run {e['run_id']}  round {e['round']}  "
              f"{e['algorithm']}  validation accuracy {_fmt(e['accuracy'])} ({e['validation_samples']} samples)  "
              f"{when}  sha256 {str(e['sha256'])[:12]}  {'onnx' if e['onnx'] else 'no onnx'}")
        if e.get("note"):
            print(f"      {e['note']}")
    if "candidate" in doc:
        c = doc["candidate"]
        print(f"refused candidate: run {c['run_id']}, accuracy {_fmt(c['accuracy'])}: {c['note']} "
              "(dflctl model deploy --force)")
    return 0


def cmd_rollback(a: argparse.Namespace) -> int:
    models = _models(a)
    before = models.current_version()
    v = models.rollback(a.to)
    print(f"current: v{before} -> v{v}")
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    if not a.force:
        raise ValueError("model deploy: the agent deploys after each run; this command deploys the refused "
                         "candidate and needs --force")
    v = _models(a).promote_candidate()
    print(f"deployed the candidate as v{v}")
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl model`` to the dflctl sub-parsers."""
    from dfl_agent.deploy import DeployError  # noqa: F401 - a ValueError: dflctl exits 2 with its message

    m = sub.add_parser("model", help="the deployed model versions (state_dir/models): show, rollback, deploy")
    ms = m.add_subparsers(dest="model_cmd", required=True)
    s = ms.add_parser("show", help="versions, the current one, and a refused candidate")
    state_dir_args(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_show)
    r = ms.add_parser("rollback", help="point current at an older version")
    state_dir_args(r)
    r.add_argument("--to", type=lambda t: int(t.lstrip("v")), default=None, metavar="VERSION",
                   help="version number (default: the newest older than the current)")
    r.set_defaults(func=cmd_rollback)
    d = ms.add_parser("deploy", help="deploy the candidate the gate refused")
    state_dir_args(d)
    d.add_argument("--force", action="store_true", help="deploy although it is worse or has few validation samples")
    d.set_defaults(func=cmd_deploy)
