"""The table engine of ``dflctl``: rows of peers and status from the retained MQTT documents,
and :class:`FitTable`, which fits a table's columns to the terminal (``peers``, ``status``,
``watch``, ``runs``).  Every field is optional; missing ones are shown empty.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dfl_agent.runtime.degraded import alone_text, degraded_fields
from dfl_agent.security.trust import is_will
from dfl_agent.transport.base import CONTROL_DROP_PREFIXES

PEER_COLUMNS = ("node_id", "trust", "state", "address", "profile", "algorithm", "model", "round", "last_seen_s",
                "privacy", "compatibility")
STATUS_COLUMNS = ("node_id", "state", "run", "round", "degraded", "privacy", "role", "sync_state", "last_sync_s",
                  "accuracy", "bytes_sent", "bytes_received", "errors", "control_dropped", "run_peak_mb")
#: drop-counter key prefixes of the control plane (presence and status messages)
CONTROL_PREFIXES = CONTROL_DROP_PREFIXES


def _age(t: Any, now: float) -> float | None:
    return round(now - float(t), 1) if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 else None


def peer_rows(statuses: dict[str, Any], presence: dict[str, Any], now: float | None = None,
              stale_after: float = 30.0) -> list[dict[str, Any]]:
    """One row per node seen in retained presence or status.

    ``state``: from presence (:func:`presence_state`): ``online``, ``offline``, ``offline (last
    will)``; for a node with a status but no presence, or whose status is newer than the
    "offline" its supervisor published when a run ended (an always-on node between runs), or
    that connected again since its last will, the status's own state (``idle``); ``stale`` when
    not offline but nothing heard for ``stale_after`` s.  ``address``
    is the device's own address when its descriptor advertises one, else ``-`` (never the
    broker's address: that is ``broker``).  ``compatibility`` is shown
    when the node's descriptor or status carries it."""
    now = time.time() if now is None else now
    excluded_by: dict[str, list[str]] = {}  # device profiles: who excludes whom, and why
    for nid, st in statuses.items():
        for peer, why in ((st or {}).get("excluded_peers") or {}).items():
            excluded_by.setdefault(peer, []).append(f"excluded by {nid}: {why}")
    rows = []
    for nid in sorted(set(presence) | set(statuses)):
        p, s = presence.get(nid, {}) or {}, statuses.get(nid, {}) or {}
        d = p.get("descriptor", {}) or {}
        seen = max([x for x in (s.get("time"), p.get("time")) if isinstance(x, (int, float))], default=0)
        state = presence_state(p, s) or s.get("state") or "unknown"
        last = _age(seen, now)
        if not state.startswith("offline") and state != "unknown" and last is not None and last > stale_after:
            state = "stale"
        compat = d.get("compatibility", s.get("compatibility", ""))
        compat = compat if isinstance(compat, str) else json.dumps(compat, sort_keys=True)
        note = "; ".join(([f"gated: {s['gated']}"] if s.get("gated") else []) + excluded_by.get(nid, []))
        # trust: the weakest of its presence and status ("unverified" without --config)
        trusts = [x.get("trust", "unverified") for x in (p, s) if x]
        trust = next((t for t in trusts if t.startswith("untrusted")), None) or next(
            (t for t in trusts if t == "unverified"), None) or (trusts[0] if trusts else "unverified")
        rows.append({
            "node_id": nid, "trust": trust, "verified": trust in ("device", "operator"), "state": state, "address": d.get("address") or "-",
            "broker": d.get("broker", ""), "profile": d.get("profile", "") or s.get("profile", ""),
            "algorithm": d.get("algorithm", "") or s.get("algorithm", ""), "model": d.get("model_hash", ""),
            "version": d.get("version", ""), "round": s.get("round"), "last_seen_s": last,
            "compatibility": "; ".join(x for x in (compat, note) if x),
            "gated": s.get("gated"), "excluded_by": excluded_by.get(nid, []), "note": note,
            "privacy": privacy_text(s.get("privacy")),
        })
    return rows


def presence_state(p: dict[str, Any], s: dict[str, Any]) -> str | None:
    """What a node's presence ``p`` says it is doing, given its status ``s`` (either may be
    empty): ``"online"``, ``"offline"``, ``"offline (last will)"`` (the broker published its
    last will: its connection broke - crashed, killed or cut off), or None when the presence
    says nothing the status does not supersede: no presence; the "offline" an always-on node's
    supervisor published when a run ended, with a newer status (the node between runs); a last
    will older than a status of another connection (the node connected again since; a will's
    time is when its connection opened)."""
    state = p.get("state")
    if not isinstance(state, str):
        return None
    if state == "offline" and s.get("state") and _newer(s.get("time"), p.get("time")):
        if p.get("reason") == "run ended":
            return None
        if is_will(p) and isinstance(s.get("session"), str) and s["session"] != p["session"]:
            return None
    return f"{state} (last will)" if is_will(p) else state


def _newer(a: Any, b: Any) -> bool:
    """Whether time ``a`` (unix s) is later than time ``b`` (False when either is missing)."""
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b


def status_rows(statuses: dict[str, Any], now: float | None = None,
                presence: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One summary row per status document: round, role, α or threshold state, last
    synchronization, accuracy, bytes, errors, the fault counters ``rounds_skipped``
    and ``paused_disconnected_s`` (missing fields are None), and ``degraded``: the rounds
    closed alone in the current run or, on an idle node, its last run (``"12/20 alone"``).
    ``state`` is the status's, but ``offline`` or ``offline (last will)`` for a node whose
    presence (``presence``: node id -> presence document) says it went offline after it
    (:func:`presence_state`), unless the status itself says it ``stopped`` or ``finished``:
    a retained status is the last one a node sent, not what it is doing now."""
    now = time.time() if now is None else now
    rows = []
    for nid in sorted(statuses):
        s = statuses[nid] or {}
        state = s.get("state")
        gone = presence_state((presence or {}).get(nid) or {}, s)
        if gone is not None and gone.startswith("offline") and state not in ("stopped", "finished"):
            state = gone
        sync = {k: s[k] for k in ("alpha_n", "alpha_last", "threshold", "theta", "hessian_sent") if k in s}
        errors = s.get("errors") if isinstance(s.get("errors"), dict) else {}
        control = {k: v for k, v in errors.items() if k.startswith(CONTROL_PREFIXES)}
        if isinstance(s.get("control_dropped"), dict):  # an idle node (run lobby)
            control.update(s["control_dropped"])
        rows.append({
            "node_id": nid, "state": state, "round": s.get("round"), "rounds": s.get("rounds"),
            # runs: "idle", or the run id with its state and round
            "run": _run_cell(s.get("run")),
            # an age in seconds; a value that is no Unix time (an older agent's monotonic
            # clock reading) means nothing here and is not shown
            "role": s.get("role"), "sync_state": sync, "last_sync_s": _age(s.get("last_synchronization"), now)
            if isinstance(s.get("last_synchronization"), (int, float)) and s.get("last_synchronization", 0) > 1e9
            else None,
            "accuracy": s.get("global_accuracy"), "local_accuracy": s.get("local_accuracy"),
            "bytes_sent": s.get("bytes_sent"), "bytes_received": s.get("bytes_received"),
            "errors": sum(v for v in errors.values() if isinstance(v, (int, float))), "errors_by_reason": errors,
            # fault tolerance: rounds skipped to catch up, seconds paused without a broker
            "rounds_skipped": s.get("rounds_skipped"), "paused_disconnected_s": s.get("paused_disconnected_s"),
            # dropped presence/status messages by reason (forged, unsigned, replayed, ...)
            "control_dropped": control,
            "degraded": _degraded(s),
            # the device's privacy budget: epsilon spent of its lifetime budget ("off": no DP)
            "privacy": privacy_text(s.get("privacy")),
            # an idle node: the peak resident memory of its last run's run process (MiB)
            "run_peak_mb": _run_peak_mb(s),
        })
    return rows


def _run_cell(run: Any) -> str | None:
    """``"r1 training@7"``; a declined or failed run with its reason (``"r2 declined@0: privacy budget: ..."``)."""
    if not isinstance(run, dict):
        return None
    cell = f"{run.get('id')} {run.get('state')}@{run.get('round', 0)}"
    return f"{cell}: {run['reason']}" if run.get("state") in ("declined", "failed") and run.get("reason") else cell


def privacy_text(p: Any) -> str:
    """A status's ``privacy`` field as a cell: ``"eps 2.41/10 (7.59 left)"``, ``"off"`` without DP
    (and without a DP history), ``""`` for an agent that does not report one."""
    if not isinstance(p, dict):
        return ""
    spent, life = p.get("epsilon_spent"), p.get("lifetime_epsilon")
    if not isinstance(spent, (int, float)) or not isinstance(life, (int, float)):
        return "off" if p.get("dp") is False else ""
    left = p.get("epsilon_remaining")
    text = f"eps {spent:.3g}/{life:g}" + (f" ({left:.3g} left)" if isinstance(left, (int, float)) else "")
    return text if p.get("dp") is not False else f"off, {text}"


def _last_run(s: dict[str, Any]) -> Any:
    """An idle node's last run's ledger entry (its ``run_history`` entry of its ``run``), or None."""
    if isinstance(s.get("run"), dict) and isinstance(s.get("run_history"), dict):
        return s["run_history"].get(s["run"].get("id"))
    return None


def _degraded(s: dict[str, Any]) -> str:
    """``"12/20 alone"`` when the node's run (training, or an idle node's last run in its
    ``run_history``) was degraded, else ``""``."""
    if "rounds_alone" not in s and isinstance(s.get("run"), dict) and isinstance(s.get("run_history"), dict):
        s = _last_run(s) or {}  # an idle node: its last run's ledger entry
    return alone_text(degraded_fields(s)) if isinstance(s, dict) else ""


def _run_peak_mb(s: dict[str, Any]) -> int | None:
    """An idle node's last run's peak resident memory of its run process (whole MiB), else None."""
    entry = _last_run(s)
    mb = entry.get("peak_rss_mb") if isinstance(entry, dict) else None
    return round(mb) if isinstance(mb, (int, float)) and not isinstance(mb, bool) else None


def fmt_cell(v: Any) -> str:
    """One table cell: empty for None, 3 decimals for a float, ``k=v`` pairs for a dict."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={fmt_cell(x)}" for k, x in v.items())
    return str(v)


#: per column: (short header, priority, may wrap).  On a narrow terminal the columns of
#: lowest priority number are kept first; a column that may wrap takes the width left over
#: and folds its value onto several lines.  Columns not listed keep their order, priority 3.
COLUMN_INFO: dict[str, tuple[str, int, bool]] = {
    "node_id": ("node", 0, False), "state": ("state", 0, False), "round": ("round", 1, False),
    "last_seen_s": ("seen_s", 1, False), "trust": ("trust", 2, True), "algorithm": ("algo", 2, False),
    "address": ("address", 3, True), "profile": ("profile", 3, False), "model": ("model", 5, False),
    "compatibility": ("compat", 4, True),
    "run": ("run", 2, True), "role": ("role", 2, False), "accuracy": ("acc", 1, False),
    "last_sync_s": ("sync_s", 3, False), "errors": ("err", 3, False), "sync_state": ("sync", 4, True),
    "bytes_sent": ("sent", 4, False), "bytes_received": ("recv", 4, False), "control_dropped": ("ctl_drop", 5, True),
    "degraded": ("degraded", 6, False), "privacy": ("privacy", 3, False), "run_peak_mb": ("run_MB", 5, False),
}
#: columns shown in bytes: compact (``12.3M``) when the table has to fit a terminal
BYTE_COLUMNS = ("bytes_sent", "bytes_received")


def _fmt_bytes(v: Any) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return fmt_cell(v)
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.1f}{unit}"
    return str(int(v))


def _priority(col: str, rows: list[dict[str, Any]]) -> int:
    """A column's priority for these rows: :data:`COLUMN_INFO`'s, raised to 1 for a warning
    (an untrusted node, an incompatibility), lowered by 3 for a column of priority >= 2 whose
    rows all say the same thing."""
    base = COLUMN_INFO.get(col, ("", 3))[1]
    values = [fmt_cell(r.get(col)) for r in rows]
    if col == "trust" and any(v.startswith("untrusted") for v in values):
        return 1
    if col == "compatibility" and any(v not in ("", "ok") for v in values):
        return 1
    if col == "degraded" and any(values):  # a node trained alone: always shown
        return 1
    if col == "privacy" and any("(0 left)" in v for v in values):  # a device with its budget spent
        return 1
    if base >= 2 and len(rows) > 1 and len(set(values)) == 1:
        return base + 3
    return base


def fit_columns(rows: list[dict[str, Any]], columns: tuple[str, ...], width: int) -> tuple[list[str], list[str]]:
    """The columns of a table that fit ``width`` terminal columns, in table order, and those left out.

    Columns are taken by priority (:func:`_priority`) while their natural width (short
    header or widest value) fits; a column that may wrap is taken when at least 12 characters
    are left (it folds its value).  The first column is always kept.
    """
    def natural(col: str) -> int:
        cells = [_fmt_bytes(r.get(col)) if col in BYTE_COLUMNS else fmt_cell(r.get(col)) for r in rows]
        return max([len(COLUMN_INFO.get(col, (col,))[0])] + [len(c) for c in cells])

    order = sorted(range(len(columns)), key=lambda i: (0 if i == 0 else _priority(columns[i], rows), i))
    used, keep = 1, set()  # the table's left border
    for i in order:
        col = columns[i]
        need = natural(col) + 3  # padding 1 + value + padding 1 + border
        wraps = COLUMN_INFO.get(col, ("", 3, False))[2]
        if used + need <= width or i == 0:
            keep.add(i)
            used += need
        elif wraps and used + min(need, 12 + 3) <= width:
            keep.add(i)
            used = width
    return [c for i, c in enumerate(columns) if i in keep], [c for i, c in enumerate(columns) if i not in keep]


class FitTable:
    """A table of ``rows`` that chooses its columns for the width it is drawn in (rich renderable).

    Where every column fits (a wide terminal; a pipe or file, which has no width limit) it is
    the full table with the column names as headers.  On a narrower terminal the less important
    columns are left out (named in the caption), headers are abbreviated, byte counts are
    compact and long values (address, compatibility) wrap instead of every value being cut.
    """

    def __init__(self, title: str, rows: list[dict[str, Any]], columns: tuple[str, ...]):
        self.title, self.rows, self.columns = title, rows, tuple(columns)

    def table(self, width: int | None = None) -> Any:
        """The rich ``Table`` for ``width`` columns (None: every column)."""
        from rich.table import Table

        short = width is not None and self._full_width() > width  # the full table does not fit
        shown, hidden = fit_columns(self.rows, self.columns, width) if short else (list(self.columns), [])
        caption = f"not shown: {', '.join(hidden)} (wider terminal or --json)" if hidden else None
        t = Table(title=self.title, caption=caption, caption_justify="left")
        for col in shown:
            head, _, wraps = COLUMN_INFO.get(col, (col, 3, False))
            t.add_column(head if short else col, no_wrap=not wraps, overflow="fold")
        for r in self.rows:
            style = "red" if str(r.get("state")).startswith(("offline", "stale")) else None
            t.add_row(*((_fmt_bytes(r.get(c)) if short and c in BYTE_COLUMNS else fmt_cell(r.get(c))) for c in shown),
                      style=style)
        return t

    def _full_width(self) -> int:
        """Terminal columns the full table takes (column names as headers, values in full)."""
        return 1 + sum(max([len(c)] + [len(fmt_cell(r.get(c))) for r in self.rows]) + 3 for c in self.columns)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.table(options.max_width)


def render_table(title: str, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> Any:
    """The table of ``rows`` for peers, status, watch and runs: a :class:`FitTable`, which keeps
    the columns that fit the terminal (every column in a pipe or a file)."""
    return FitTable(title, rows, columns)
