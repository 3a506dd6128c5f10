"""The demo's live table fits the terminal by leaving out less important columns, never by
truncating one (at 0c2393f an 80-column terminal showed ``feder…``)."""

from __future__ import annotations

import io

from rich.console import Console

from dfl_agent.cli.demo import _table

STATUS = {"state": "running", "round": 12, "global_accuracy": 0.8123, "local_only_global_accuracy": 0.7011,
          "live_peers": ["user03", "user05", "user07", "user08"], "bytes_sent": 123456789,
          "bytes_received": 98765432, "errors": {"replay": 2}}
IDS = ["user01", "user03", "user05", "user07", "user08"]


def _render(width: int, statuses=None) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    con.print(_table(statuses or {n: STATUS for n in IDS}, {}, IDS, 20, width=con.width))
    return buf.getvalue()


def _header(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if "node" in line)
    return [c.strip() for c in line.strip("┃│ ").split("┃") if c.strip()]


def test_at_80_columns_less_important_columns_go_and_none_is_truncated():
    text = _render(80)
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    cols = _header(text)
    assert cols[:4] == ["node", "state", "round", "federated"] and "alone" in cols
    assert "recv MB" not in cols  # the first to go
    assert "0.812" in text and "12/20" in text


def test_a_wide_terminal_shows_every_column():
    assert _header(_render(160)) == ["node", "state", "round", "federated", "alone", "peers", "sent MB", "recv MB",
                                     "dropped"]


def test_dfml_columns_fit_at_80_too():
    dfml = {n: {**STATUS, "regular_global_accuracy": 0.8, "participated": True} for n in IDS}
    text = _render(80, dfml)
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    assert {"peak", "regular", "alone"} <= set(_header(text))
