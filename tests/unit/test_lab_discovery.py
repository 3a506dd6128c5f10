"""The field lab's discovery report (dfl_agent.cli.lab.report): from the agents' round
records (``peers_found``), how each device found each peer, every way used, the same-site
pairs that mDNS did not find on the peer's lab address, and the time to full membership;
the ``discovery_via = "mdns"`` check fails on such a pair."""

from __future__ import annotations

from types import SimpleNamespace

from dfl_agent.cli.lab.report import _discovery, evaluate_checks
from dfl_agent.cli.lab.scenario import parse

DOC = {"site": [{"name": "a"}, {"name": "b"}], "class": [{"name": "pi"}],
       "device": [{"class": "pi", "site": "a", "count": 2}, {"class": "pi", "site": "b"}],
       "run": [{"at_s": 1, "algorithm": "fedavg", "rounds": 2}], "checks": {"discovery_via": "mdns"}}
ADDR = {"pi-0": "198.18.0.11", "pi-1": "198.18.0.12", "pi-2": "198.18.1.11"}


def _found(how: str, t: float, peer: str, port: bool = True) -> dict:
    return {how: {"t": t, "address": f"{ADDR[peer]}:40000" if port else ADDR[peer]}}


def _run(tmp_path, near_by_mdns: bool = True):
    sc = parse(DOC)
    agents = {d.id: SimpleNamespace(device=d) for d in sc.devices}
    near = "mdns" if near_by_mdns else "presence"
    recs = {  # round records of run r-1 (submitted at t = 100)
        "pi-0": {"r-1": [{"round": 1, "peers_found": {"pi-1": {**_found("presence", 101.0, "pi-1", False),
                                                               **_found(near, 103.0, "pi-1")},
                                                      "pi-2": _found("bridged-presence", 101.5, "pi-2", False)}},
                         {"round": 2}]},
        "pi-1": {"r-1": [{"round": 1, "peers_found": {"pi-0": _found("mdns", 102.0, "pi-0"),
                                                      "pi-2": _found("bridged-presence", 101.2, "pi-2", False)}}]},
        "pi-2": {"r-1": [{"round": 1, "peers_found": {"pi-0": _found("bridged-presence", 101.0, "pi-0", False)}},
                         {"round": 2, "peers_found": {"pi-1": _found("bridged-presence", 108.0, "pi-1", False)}}]},
    }
    run = SimpleNamespace(sc=sc, agents=agents, out=tmp_path, fed="lab", lab_hosts=ADDR, run_ids=["r-1"],
                          run_submitted=[100.0], t0=90.0)
    return sc, run, recs


def test_how_each_device_found_its_peers(tmp_path):
    sc, run, recs = _run(tmp_path)
    d = _discovery(run, recs)
    assert d["via"] == ["mdns", "presence", "bridged-presence"]
    assert d["mdns_missing"] == []
    assert d["seconds_to_full_membership"] == 8.0  # pi-2 found pi-1 last, at 108
    assert d["peers_found"]["pi-0"]["pi-1"] == {"presence": {"at_s": 11.0, "address": "198.18.0.12"},
                                                "mdns": {"at_s": 13.0, "address": "198.18.0.12:40000"}}
    rep = {"devices": [], "events": [], "runs": [], "discovery": d, "final_accuracy_mean": None}
    assert evaluate_checks(sc, rep) == []


def test_a_same_site_pair_not_found_by_mdns_fails_the_check(tmp_path):
    sc, run, recs = _run(tmp_path, near_by_mdns=False)
    d = _discovery(run, recs)
    assert d["mdns_missing"] == ["pi-0 -> pi-1"]  # the other site's devices need no mDNS
    rep = {"devices": [], "events": [], "runs": [], "discovery": d, "final_accuracy_mean": None}
    assert evaluate_checks(sc, rep) == ["discovery_via: membership did not form through mdns (seen: mdns, presence, "
                                        "bridged-presence; not through mdns on the lab address: pi-0 -> pi-1)"]
    del recs["pi-2"]["r-1"][1]  # pi-2 never found pi-1: no full membership
    assert _discovery(run, recs)["seconds_to_full_membership"] is None
