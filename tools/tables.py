"""The table engine of ``dflctl``: rows of peers and status from the retained MQTT documents,
and :class:`FitTable`, which fits a table's columns to the terminal (``peers``, ``status``,
``watch``, ``runs``).  Every field is optional; missing ones are shown empty.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dfl_agent.runtime.shared.degraded import alone_text, degraded_fields
from dfl_agent.security.trust import is_will
from dfl_agent.transport.base import CONTROL_DROP_PREFIXES

PEER_COLUMNS = ("node_id", "trust", "state", "address", "profile", "algorithm", "model", "version", "wire", "round",
                "last_seen_s", "privacy", "compatibility")
STATUS_COLUMNS = ("node_id", "state", "run", "round", "degraded", "privacy", "role", "sync_state", "last_sync_s",
                  "accuracy", "bytes_sent", "bytes_received", "errors", "control_dropped", "run_peak_mb")
#: drop-counter key prefixes of the control plane (presence and status messages)
CONTROL_PREFIXES = CONTROL_DROP_PREFIXES


def _age(t: Any, now: float) -> float | None:
    return round(now - float(t), 1) if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 else None


def peer_rows(statuses: dict[str, Any], presence: dict[str, Any], now: float | None = None,
              stale_after: float = 30.0, privacy_seen: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per node seen in retained presence or status.

    ``state``: from presence (:func:`presence_state`): ``online``, ``offline``, ``offline (last
    will)``; for a node with a status but no presence, or whose status is newer than the
    "offline" its supervisor published when a run ended (an always-on node between runs), or
    that connected again since its last will, the status's own state (``idle``); ``stale`` when
    not offline but nothing heard for ``stale_after`` s; ``revoked`` (``trust`` too, and
    ``revoked`` holds the reason) for a node the federation's revocation list names.  ``version``
    and ``wire``: the node's release and the wire versions it speaks (:func:`node_versions`).  ``address``
    is the device's own address when its descriptor advertises one, else ``-`` (never the
    broker's address: that is ``broker``).  ``compatibility`` is shown
    when the node's descriptor or status carries it.  ``privacy``: the node's budget, flagged when
    its reported ε went down (:func:`privacy_down`; ``privacy_seen``: the observer's own
    :meth:`~dfl_agent.runtime.service.privacy_budget.PrivacyWatch.view`)."""
    now = time.time() if now is None else now
    down = privacy_down(statuses, privacy_seen)
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
        revoked = next((x.get("revoked", "") for x in (p, s) if x.get("trust") == "revoked"), None)
        compat = d.get("compatibility", s.get("compatibility", ""))
        compat = compat if isinstance(compat, str) else json.dumps(compat, sort_keys=True)
        note = "; ".join(([f"gated: {s['gated']}"] if s.get("gated") else []) + excluded_by.get(nid, []))
        # trust: the weakest of its presence and status ("unverified" without --config)
        trusts = [x.get("trust", "unverified") for x in (p, s) if x]
        trust = "revoked" if revoked is not None else next((t for t in trusts if t.startswith("untrusted")), None) \
            or next((t for t in trusts if t == "unverified"), None) or (trusts[0] if trusts else "unverified")
        rows.append({
            # a node the federation revoked is shown "revoked" whatever it says of itself
            "node_id": nid, "trust": trust, "verified": trust in ("device", "operator"),
            "state": "revoked" if revoked is not None else state, "address": d.get("address") or "-",
            "broker": d.get("broker", ""), "profile": d.get("profile", "") or s.get("profile", ""),
            "algorithm": d.get("algorithm", "") or s.get("algorithm", ""), "model": d.get("model_hash", ""),
            **node_versions(d, s), "round": s.get("round"), "last_seen_s": last,
            "compatibility": "; ".join(x for x in (compat, note) if x), "revoked": revoked,
            "gated": s.get("gated"), "excluded_by": excluded_by.get(nid, []), "note": note,
            "privacy": privacy_text(s.get("privacy"), down.get(nid)), "privacy_decreased": down.get(nid),
        })
    return rows


def node_versions(descriptor: dict[str, Any], status: dict[str, Any]) -> dict[str, str]:
    """A node's ``version`` (its release, ``"0.2.0"``) and ``wire`` (the wire versions it speaks,
    ``"5"`` or ``"5,6"``) from its presence descriptor (``version = "0.2.0/w5"``, ``wires``) or its
    status (``agent_version``, ``wires``: an always-on agent between runs has no presence); an
    agent of 0.1.0 announces only ``"0.1.0/w5"``.  Empty when the node says nothing."""
    from dfl_agent.transport.versions import versions_of

    announced = descriptor.get("version")
    package = announced.rsplit("/w", 1)[0] if isinstance(announced, str) else ""
    if not package and isinstance(status.get("agent_version"), str):
        package = status["agent_version"]
    wires = versions_of(descriptor.get("wires")) or versions_of(status.get("wires")) or versions_of(None, announced)
    return {"version": package, "wire": ",".join(map(str, wires))}


def certificate_warnings(statuses: dict[str, Any], now: float | None = None) -> list[str]:
    """One line per node whose status says its certificate (``certificate_expires``) expired or
    expires within :data:`~dfl_agent.security.keys.EXPIRY_WARNING_DAYS` days, naming the node
    and the date; and one per node the federation revoked."""
    from dfl_agent.security.keys import EXPIRY_WARNING_DAYS, utc_date

    now = time.time() if now is None else now
    lines = []
    for nid in sorted(statuses):
        s = statuses[nid] or {}
        if s.get("trust") == "revoked":
            lines.append(f"node {nid} is revoked ({s.get('revoked') or 'revocation list'}): its peers ignore it")
            continue
        exp = s.get("certificate_expires")
        if not isinstance(exp, (int, float)) or isinstance(exp, bool):
            continue
        left = (exp - now) / 86400.0
        if left < 0:
            lines.append(f"the certificate of node {nid} expired on {utc_date(exp)}: its peers refuse it "
                         f"(dflctl keys renew {nid})")
        elif left <= EXPIRY_WARNING_DAYS:
            lines.append(f"the certificate of node {nid} expires on {utc_date(exp)} (in {left:.0f} days): "
                         f"dflctl keys renew {nid}")
    return lines


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
                presence: dict[str, Any] | None = None,
                privacy_seen: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One summary row per status document: round, role, α or threshold state, last
    synchronization, accuracy, bytes, errors, the fault counters ``rounds_skipped``
    and ``paused_disconnected_s`` (missing fields are None), and ``degraded``: the rounds
    closed alone in the current run or, on an idle node, its last run (``"12/20 alone"``).
    ``state`` is the status's, but ``offline`` or ``offline (last will)`` for a node whose
    presence (``presence``: node id -> presence document) says it went offline after it
    (:func:`presence_state`), unless the status itself says it ``stopped`` or ``finished``:
    a retained status is the last one a node sent, not what it is doing now.  ``privacy``
    as in :func:`peer_rows`."""
    now = time.time() if now is None else now
    down = privacy_down(statuses, privacy_seen)
    rows = []
    for nid in sorted(statuses):
        s = statuses[nid] or {}
        state = s.get("state")
        gone = presence_state((presence or {}).get(nid) or {}, s)
        if gone is not None and gone.startswith("offline") and state not in ("stopped", "finished"):
            state = gone
        if s.get("trust") == "revoked":  # the federation's revocation list names it
            state = "revoked"
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
            # the device's privacy budget: epsilon spent of its lifetime budget ("off": no DP),
            # flagged when it went down (a reset ledger)
            "privacy": privacy_text(s.get("privacy"), down.get(nid)), "privacy_decreased": down.get(nid),
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


def privacy_text(p: Any, down: dict[str, Any] | None = None) -> str:
    """A status's ``privacy`` field as a cell: ``"eps 2.41/10 (7.59 left)"``, ``"off"`` without DP
    (and without a DP history), ``"ledger damaged"`` when the device's privacy ledger failed its
    check, ``""`` for an agent that does not report one; with ``down`` (:func:`privacy_down`'s
    entry) ``"eps 0/10 (10 left) DOWN from 8 (seen by dev2)"``."""
    if not isinstance(p, dict):
        return ""
    suffix = f" DOWN from {down['was']:.4g} (seen by {', '.join(down['by'])})" if down else ""
    if p.get("ledger") == "damaged":
        return "ledger damaged" + suffix
    spent, life = p.get("epsilon_spent"), p.get("lifetime_epsilon")
    if not isinstance(spent, (int, float)) or not isinstance(life, (int, float)):
        return ("off" if p.get("dp") is False else "") + suffix
    left = p.get("epsilon_remaining")
    text = f"eps {spent:.3g}/{life:g}" + (f" ({left:.3g} left)" if isinstance(left, (int, float)) else "")
    return (text if p.get("dp") is not False else f"off, {text}") + suffix


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def privacy_down(statuses: dict[str, Any], seen: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The devices whose reported privacy ε went down: node id -> ``{"was", "now", "by"}``, from
    the ``privacy.peers_decreased`` of the other nodes' statuses (each agent watches its peers; an
    untrusted status is not taken) and ``seen`` (this observer's own watch, ``by`` "dflctl").  A
    device whose status now reports at least ``was`` again (a recovery) is not flagged."""
    out: dict[str, dict[str, Any]] = {}

    def take(node: Any, flag: Any, by: str) -> None:
        if isinstance(node, str) and isinstance(flag, dict) and _number(flag.get("was")) and _number(flag.get("now")):
            cur = out.setdefault(node, {"was": flag["was"], "now": flag["now"], "by": []})
            cur["was"] = max(cur["was"], flag["was"])
            cur["by"].append(by)

    for reporter, st in sorted(statuses.items()):
        flags = ((st or {}).get("privacy") or {}).get("peers_decreased")
        if isinstance(flags, dict) and not str((st or {}).get("trust", "")).startswith("untrusted"):
            for node, flag in flags.items():
                take(node, flag, reporter)
    for node, flag in (seen or {}).items():
        take(node, flag, "dflctl")
    for node in list(out):
        now = ((statuses.get(node) or {}).get("privacy") or {}).get("epsilon_spent")
        if _number(now) and now >= out[node]["was"] - 1e-3:
            del out[node]
        elif _number(now):
            out[node]["now"] = now
    return out


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
    "compatibility": ("compat", 4, True), "version": ("version", 2, False), "wire": ("wire", 3, False),
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
    if col == "privacy" and any("(0 left)" in v or " DOWN " in v or "damaged" in v for v in values):
        return 1  # a device with its budget spent, reset or damaged
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
