"""``dflctl peers`` for always-on nodes between runs: they publish a status, no presence."""

from __future__ import annotations

from dfl_agent.cli.tables import peer_rows


def test_idle_node_without_presence_shows_its_status_state() -> None:
    now = 1_800_000_000.0
    statuses = {"node0": {"state": "idle", "time": now - 2.0, "round": 0},
                "node1": {"state": "idle", "time": now - 100.0, "round": 0},
                "node2": {"state": "training", "time": now - 1.0, "round": 3}}
    presence = {"node2": {"state": "online", "time": now - 1.0}}
    rows = {r["node_id"]: r for r in peer_rows(statuses, presence, now=now)}
    assert rows["node0"]["state"] == "idle"
    assert rows["node1"]["state"] == "stale"  # its retained status is old: the agent is gone
    assert rows["node2"]["state"] == "online"  # presence wins when there is one


def test_offline_presence_wins_over_an_old_status() -> None:
    now = 1_800_000_000.0
    rows = peer_rows({"n": {"state": "finished", "time": now - 100.0}}, {"n": {"state": "offline"}}, now=now)
    assert rows[0]["state"] == "offline"
    assert peer_rows({}, {"m": {}}, now=now)[0]["state"] == "unknown"


def test_a_node_back_to_idle_after_its_run_shows_idle_not_offline() -> None:
    """The supervisor publishes "offline" (reason "run ended") when a run process ends, then
    its idle status heartbeats: the newer status says what the node does."""
    now = 1_800_000_000.0
    presence = {"n": {"state": "offline", "reason": "run ended", "time": now - 10.0}}
    rows = peer_rows({"n": {"state": "idle", "time": now - 1.0}}, presence, now=now)
    assert rows[0]["state"] == "idle"
    crashed = peer_rows({"n": {"state": "training", "time": now - 10.0}}, {"n": {"state": "offline", "time": now - 1.0}},
                        now=now)
    assert crashed[0]["state"] == "offline"  # an offline newer than the last status stays offline
    # a last will carries the time its connection opened, older than the last status: still offline
    will = peer_rows({"n": {"state": "running", "time": now - 1.0}}, {"n": {"state": "offline", "time": now - 60.0}},
                     now=now)
    assert will[0]["state"] == "offline"
