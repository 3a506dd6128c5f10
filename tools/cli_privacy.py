"""``dflctl privacy verify|recover``: the device's privacy ledger, checked and recovered (torch-free).

``dflctl privacy verify --state-dir S``
    checks the ledger's hash chain, its table of runs and its head marker, and prints the chain's
    state and the composed epsilon spent (exit code 0), or the one line that says what is wrong
    and what the device's records still show of its spent epsilon (exit code 1).
``dflctl privacy recover --state-dir S --spent-epsilon E``
    for a damaged ledger only: moves its files aside (``privacy/damaged-TIME/``) and starts a new
    chain whose first row records E as already spent; E must be at least what the device's
    records still show (the head marker, the rows that still read).  The agent admits DP runs
    again against E plus what they spend.  It never lowers a spent budget.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.cli_data import resolve, state_dir_args

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def _delta(a: argparse.Namespace, sd: Path, cfg: Any) -> float:
    """``--delta``, else the device's ``privacy.dp.delta`` (``--config``), else the head marker's,
    else the default δ."""
    from dfl_agent.privacy.config import DEFAULT_DELTA
    from dfl_agent.runtime.shared.privacy_ledger import LedgerDamaged, read_head

    if a.delta is not None:
        return float(a.delta)
    if cfg is not None:
        from dfl_agent.profiles import resolve_profile
        from dfl_agent.runtime.shared.privacy_ledger import device_privacy

        dp = device_privacy(cfg, resolve_profile(cfg.profile, cfg.profile_overrides)[0]).dp
        if dp is not None:
            return float(dp.delta)
    try:
        head = read_head(sd)
    except LedgerDamaged:
        head = None
    if head is not None and isinstance(head.get("delta"), (int, float)):
        return float(head["delta"])
    return DEFAULT_DELTA


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def cmd_verify(a: argparse.Namespace) -> int:
    from dfl_agent.runtime.service.privacy_recovery import salvage
    from dfl_agent.runtime.shared.privacy_ledger import HEAD_FILE, LedgerDamaged, PrivacyLedger, read_head

    sd, cfg = resolve(a)
    delta = _delta(a, sd, cfg)
    ledger = PrivacyLedger(sd)
    doc: dict[str, Any] = {"ledger": str(ledger.path), "head_marker": str(sd / HEAD_FILE), "delta": delta}
    try:
        state, st = ledger.check()
    except sqlite3.OperationalError as exc:  # busy, no permission: one line, exit 2
        raise ValueError(f"privacy ledger {ledger.path}: cannot be read ({exc})") from None
    except LedgerDamaged as exc:
        records = salvage(sd, delta)
        doc.update(state="damaged", error=exc.what, message=str(exc),
                   records=[{"source": s, "epsilon": round(e, 6)} for s, e in records])
        if a.json:
            print(json.dumps(doc, indent=2, sort_keys=True))
            return 1
        print(exc)
        for source, eps in records:
            print(f"  the device's records still show epsilon {eps:.6g} from {source}")
        if not records:
            print("  nothing readable is left of the device's records: take the spent epsilon from your own "
                  "(dflctl status history, the run ledger, the deployed models' manifests)")
        return 1
    doc["state"] = state
    if state == "unchained":
        msg = (f"privacy ledger {ledger.path}: written by an older release and not chained yet (the agent chains "
               "it when it next starts)")
        doc["message"] = msg
        print(json.dumps(doc, indent=2, sort_keys=True) if a.json else msg)
        return 0
    assert st is not None
    rows = list(st.rows.values())
    counts = {s: sum(1 for r in rows if r["state"] == s) for s in ("spent", "released", "reserved")}
    carried = sum(float(c["epsilon"]) for c in st.carried)
    eps = st.epsilon(delta)
    head = read_head(sd)
    folded = int(st.folded.get("runs", 0))
    doc.update(rows=st.events, runs=len(rows), folded=folded, **counts, head=st.head, chain=st.chain,
               marker_rows=head["events"] if head else None, epsilon=round(eps, 6), epsilon_carried=round(carried, 6),
               recoveries=[{"epsilon": c["epsilon"], "delta": c["delta"], "time": c.get("time"),
                            "reason": c.get("reason")} for c in st.carried])
    if a.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    if state == "empty":
        print(f"no privacy ledger under {sd} (no DP history)")
        return 0
    marker = f"its head marker records row {head['events']}" if head else "no head marker yet"
    print(f"privacy ledger {ledger.path}: ok: {st.events} row{'s' if st.events != 1 else ''} of history, "
          f"{len(rows)} run{'s' if len(rows) != 1 else ''} ({counts['spent']} spent, "
          f"{counts['released']} released, {counts['reserved']} reserved"
          f"{f'; and {folded} older spent runs folded' if folded else ''}), head {st.head[:12]}, "
          f"{marker}")
    print(f"epsilon spent {eps:.6g} at delta {delta:g}")
    for c in st.carried:
        print(f"  of which {float(c['epsilon']):.6g} (at delta {c['delta']:g}) carried over by a recovery on "
              f"{_when(c.get('time'))}: {c.get('reason', '')}")
    return 0


def cmd_recover(a: argparse.Namespace) -> int:
    from dfl_agent.runtime.service.privacy_recovery import recover

    sd, cfg = resolve(a)
    delta = _delta(a, sd, cfg)
    try:
        eps, moved = recover(sd, float(a.spent_epsilon), delta)
    except (sqlite3.Error, OSError) as exc:
        raise ValueError(f"privacy ledger {sd / 'privacy' / 'ledger.sqlite'}: cannot be recovered ({exc})") from None
    print(f"privacy ledger {sd / 'privacy' / 'ledger.sqlite'}: a new chain opens with epsilon {eps:.6g} "
          f"spent at delta {delta:g}; the agent admits DP runs against it from its next admission")
    if moved is not None:
        print(f"the damaged files are kept in {moved}")
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl privacy`` to the dflctl sub-parsers."""
    p = sub.add_parser("privacy", help="the device's privacy ledger: verify its hash chain, recover a damaged one")
    ps = p.add_subparsers(dest="privacy_cmd", required=True)
    v = ps.add_parser("verify", help="check the privacy ledger (hash chain, table of runs, head marker); exit code 1 "
                                     "when it is damaged")
    state_dir_args(v)
    v.add_argument("--delta", type=float, default=None,
                   help="the delta of the epsilon shown (default: the device's privacy.dp.delta with --config, else "
                        "the ledger's)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_verify)
    r = ps.add_parser("recover", help="start a new chain for a damaged ledger, its first row the epsilon this "
                                      "device has spent (never less than its records still show)")
    state_dir_args(r)
    r.add_argument("--spent-epsilon", type=float, required=True, metavar="E",
                   help="the epsilon this device has spent, from your records (dflctl status history, the run "
                        "ledger, deployed models' manifests); at least what 'privacy verify' shows")
    r.add_argument("--delta", type=float, default=None,
                   help="the delta at which E holds (default: the device's privacy.dp.delta with --config, else the "
                        "ledger's)")
    r.set_defaults(func=cmd_recover)
