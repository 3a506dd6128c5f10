"""The field lab counts a round alone as the node does (``round_alone``): a round whose peers'
updates all came flagged cold (their training diverged) heard them, and is not alone."""

from __future__ import annotations

from dfl_agent.cli.lab.report import _used_peers
from dfl_agent.runtime.shared.degraded import peer_updates_used


def test_a_round_with_only_cold_peers_is_not_alone_in_the_lab_either() -> None:
    cold = {"neighbours": 0, "neighbour_ids": [], "cold_excluded": ["pi-0", "pi-2"]}
    none = {"neighbours": 0, "neighbour_ids": []}
    used = {"neighbours": 1, "neighbour_ids": ["pi-0"], "cold_excluded": ["pi-2"]}
    for rec in (cold, none, used):
        assert _used_peers(rec) == peer_updates_used(rec)
    assert _used_peers(cold) == 2 and _used_peers(none) == 0
