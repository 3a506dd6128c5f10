"""Always-on agents and runs (real mosquitto, real ``dfl-agent run`` processes,
``dflctl run`` as a subprocess).

One broker and one fleet of three long-lived agents (no ``[algorithm]`` section, signatures
required) serve every test of this module, in order, as an operator would use them:

* ``dflctl run submit`` sends nothing unsigned or signed by a device to agents that require
  signed runs (exit 2); a key no agent trusts is refused by every agent and submit says so
  (exit 1); descriptors signed by a device key, an unknown key, or unsigned are refused by every
  agent (counted in status) and nothing trains;
* two runs submitted one after the other (fedavg with ``--models H1``, then dechw with
  ``--init fresh``) finish on all three, each round aggregated the other agents' models
  (neighbour ids in the per-run metrics), the family's model was built, each run's ``init``
  reached the agents (round 1's record), and the agents are idle and running afterwards;
  cancelling a finished run is refused (exit 1, no cancel record);
* a run whose algorithm a device's profile does not allow (a2 lists fedavg, dechw, dfedavg and
  heterofl, not cfa) is declined there with that reason while the other two run it, and
  ``run submit`` prints each device's answer;
* an agent SIGKILLed mid-run is restarted and rejoins the run at the federation's round
  from its checkpoint; ``dflctl run cancel`` stops training within one round of the round
  each agent had completed when the cancel reached it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.fleet import fetch_retained, publish_retained
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.runtime.shared.descriptor import (
    RunDescriptor,
    cancel_topic,
    operator_certificate,
    run_topic,
    sign_descriptor,
)
from dfl_agent.security.keys import (
    CERT_FILE,
    KEY_FILE,
    enroll_local,
    load_certificate,
    load_private_key,
    public_key_b64,
    save_certificate,
    save_private_key,
)
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto]

IDS = ("a0", "a1", "a2")
ALL_BUT_CFA = ["fedavg", "dechw", "dfedavg", "heterofl"]


def _config(tmp: Path, fed: str, nid: str, i: int, broker: str, fed_key: Ed25519PrivateKey, **extra) -> Path:
    state = tmp / nid
    enroll_local(fed_key, fed, nid, state)
    raw = {
        "federation": fed, "node_id": nid, "state_dir": str(state),
        "data": {"dataset": "digits", "partition": "iid", "num_nodes": len(IDS), "node_index": i},
        "model": {"size": "small"}, "training": {"steps": 5},
        "mqtt": {"broker": broker, "heartbeat_interval": 1.0},
        "discovery": {"min_peers": len(IDS) - 1, "start_timeout": 20.0, "mdns": False},
        "security": {"require_signatures": True, "federation_key": public_key_b64(fed_key)},
        # the papers' lock step: a killed member is waited for (until its heartbeats stop) and
        # rejoins at its round; under the quorum its neighbours go on without it
        "runtime": {"straggler": "paper"},
        **extra,
    }
    text = dump_toml(config_from_dict(raw))
    text = re.sub(r"\[algorithm\]\n(?:[^\[\n].*\n)*", "", text + "\n")  # no default run: wait for runs
    path = tmp / f"{nid}.toml"
    path.write_text(text)
    return path


def _start(tmp: Path, nid: str, path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=open(tmp / f"{nid}.log", "a"), stderr=subprocess.STDOUT)


def run_dflctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", *args], capture_output=True, text=True,
                          timeout=120)


def dflctl(*args: str) -> str:
    r = run_dflctl(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@dataclass
class Fleet:
    tmp: Path
    fed: str
    broker: str
    operator: Path
    paths: dict[str, Path]
    procs: dict[str, subprocess.Popen]
    obs: Observer
    logs: list[Path] = field(default_factory=list)
    said: str = ""

    @property
    def b(self) -> list[str]:
        return ["--broker", self.broker, "--federation", self.fed]

    def wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.3)
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.logs)
        raise AssertionError(f"timed out waiting for {what}\n{tails}")

    def status(self, nid: str) -> dict:
        return self.obs.snapshot()[0].get(nid, {})

    def run_states(self, run_id: str) -> dict[str, dict]:
        statuses = self.obs.snapshot()[0]
        return {n: s["run"] for n, s in statuses.items()
                if isinstance(s.get("run"), dict) and s["run"].get("id") == run_id}

    def metrics(self, nid: str, run_id: str) -> list[dict]:
        from dfl_agent.runtime.service.retention import read_records

        return read_records(self.tmp / nid / "runs" / run_id)  # gzipped once the run ended

    def trained(self, nid: str, run_id: str) -> list[dict]:
        """Rounds trained with neighbours (records with ``neighbour_ids``)."""
        return [r for r in self.metrics(nid, run_id) if "neighbour_ids" in r]

    def submit(self, *args: str) -> str:
        """``dflctl run submit`` as the operator: the run id (its stderr, with the devices'
        answers, in :attr:`said`)."""
        r = run_dflctl("run", "submit", *self.b, "--operator-dir", str(self.operator), *args)
        assert r.returncode == 0, r.stderr
        self.said = r.stderr
        return r.stdout.strip()

    def all_idle(self) -> bool:
        return all(self.status(n).get("state") == "idle" for n in IDS)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    fed = "runs-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    with start_broker("mosquitto") as broker:
        paths = {nid: _config(tmp, fed, nid, i, broker.endpoint, fed_key,
                              **({"profile_overrides": {"behaviour": {"algorithms": ALL_BUT_CFA}}}
                                 if nid == "a2" else {}))
                 for i, nid in enumerate(IDS)}
        op = tmp / "operator"
        op.mkdir()
        key = Ed25519PrivateKey.generate()
        save_private_key(key, op / "operator_key.pem")
        save_certificate(operator_certificate(fed_key, fed, "alice", public_key_b64(key)), op / "operator_cert.json")
        procs = {nid: _start(tmp, nid, paths[nid]) for nid in IDS}
        obs = Observer(broker.endpoint, fed).start()
        f = Fleet(tmp, fed, broker.endpoint, op, paths, procs, obs, [tmp / f"{n}.log" for n in IDS])
        try:
            f.wait(f.all_idle, 120, "three idle agents")
            yield f
        finally:
            obs.stop()
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(timeout=60)
    for log in f.logs:
        assert "Traceback" not in log.read_text()


def test_non_operator_runs_are_refused_by_dflctl_and_by_every_agent(fleet: Fleet, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    save_private_key(Ed25519PrivateKey.generate(), stranger / "key.pem")
    b = fleet.b
    # dflctl sends nothing unsigned, nor signed by a device, to agents whose statuses say they require signed runs
    for extra in ([], ["--operator-dir", str(fleet.tmp / "a0")]):  # unsigned; a0's key and device certificate
        r = run_dflctl("run", "submit", *b, *extra, "--algorithm", "fedavg", "--rounds", "2", "--run-id", "r-unsent")
        assert r.returncode == 2 and "--operator-dir" in r.stderr and "nothing was sent" in r.stderr, r.stderr
        assert "3 of its 3 device(s) require signed runs" in r.stderr, r.stderr
    assert fetch_retained(fleet.broker, run_topic(fleet.fed, "r-unsent"), absent_after=0.5) is None
    # a key that no agent trusts: sent, refused by every agent, and submit says so
    r = run_dflctl("run", "submit", *b, "--operator-dir", str(stranger), "--algorithm", "fedavg", "--rounds", "2")
    assert r.returncode == 1, r.stderr
    assert all(f"  {n}: refused: unknown_key" in r.stderr for n in IDS), r.stderr
    assert f"every device that answered refused run {r.stdout.strip()}" in r.stderr
    bad = [r.stdout.strip()]
    # the other two published as anyone on the broker may, without dflctl: refused by every agent
    a0 = fleet.tmp / "a0"
    for rid, key, signer, cert in (("r-device", load_private_key(a0 / KEY_FILE), "a0", load_certificate(a0 / CERT_FILE)),
                                   ("r-unsigned", None, "", None)):
        d = RunDescriptor(run_id=rid, federation=fleet.fed, algorithm="fedavg", rounds=2, submitted_at=time.time(),
                          not_after=time.time() + 3600)
        publish_retained(fleet.broker, run_topic(fleet.fed, rid), sign_descriptor(d, key, signer, cert))
        bad.append(rid)
    fleet.wait(lambda: all(sum(fleet.status(n).get("runs_refused", {}).values()) >= 3 for n in IDS), 60,
               "three refusals on every agent")
    for n in IDS:
        refused = fleet.status(n)["runs_refused"]
        assert refused == {"not_operator": 1, "unknown_key": 1, "unsigned": 1}, refused
        assert not any((fleet.tmp / n / "runs" / r).exists() for r in bad)  # nothing trained
        assert fleet.status(n)["state"] == "idle"


def test_agents_stay_up_across_two_submitted_runs(fleet: Fleet):
    rids = {}
    for algorithm, extra in (("fedavg", ["--models", "H1"]), ("dechw", ["--init", "fresh"])):
        rid = rids[algorithm] = fleet.submit("--algorithm", algorithm, "--rounds", "3", "--option",
                                             "round_timeout=20", "--name", algorithm, *extra)
        fleet.wait(lambda: {n: r.get("state") for n, r in fleet.run_states(rid).items()}
                   == {n: "finished" for n in IDS}, 240, f"{algorithm} run finished on all three")
        show = json.loads(dflctl("run", "show", rid, *fleet.b, "--json"))
        assert show["state"] == "finished" and show["algorithm"] == algorithm and show["rounds"] == 3
        assert show["init"] == ("fresh" if algorithm == "dechw" else None)  # None: each node's runtime.run_init
        assert set(show["nodes"]) == set(IDS)
        for n in IDS:
            rounds = fleet.trained(n, rid)
            assert [r["round"] for r in rounds] == [1, 2, 3], (n, rounds)
            assert all(r["run"] == rid for r in rounds)
            # the run's init reached the node (dechw: --init fresh; fedavg: the node's default, with no
            # model deployed here to start from)
            assert rounds[0]["init"] == ("fresh" if algorithm == "dechw" else "deployed"), rounds[0]
            assert rounds[0]["started_from"] is None and rounds[0]["init_reason"] == (
                "init = fresh" if algorithm == "dechw" else "no model is deployed on this device yet")
            heard = set().union(*(r["neighbour_ids"] for r in rounds))
            assert heard == set(IDS) - {n}, (n, algorithm, heard)  # aggregated each other's models
    for n in IDS:  # --models H1: the family's member for the profile's tier (medium: widths [32, 64]) was built
        text = (fleet.tmp / f"{n}.log").read_text()
        assert re.search(r"fedavg, \d+ train / \d+ val samples \(users .*\), model cnn\b", text), n
        assert re.search(r"dechw, \d+ train / \d+ val samples \(users .*\), model mlp\b", text), n
    fleet.wait(fleet.all_idle, 60, "idle after the runs")
    assert all(p.poll() is None for p in fleet.procs.values())
    listed = json.loads(dflctl("run", "list", *fleet.b, "--json"))["runs"]
    assert {r["run_id"]: r["state"] for r in listed if r["run_id"] in rids.values()} == \
        {rid: "finished" for rid in rids.values()}
    # cancelling a run that every member finished: refused, and no cancel record is written
    r = run_dflctl("run", "cancel", rids["fedavg"], *fleet.b, "--operator-dir", str(fleet.operator))
    assert r.returncode == 1 and f"run {rids['fedavg']} already finished on every member" in r.stderr, r.stderr
    assert fetch_retained(fleet.broker, cancel_topic(fleet.fed, rids["fedavg"]), absent_after=0.5) is None
    assert json.loads(dflctl("run", "show", rids["fedavg"], *fleet.b, "--json"))["state"] == "finished"


def test_a_member_back_after_its_run_ended_elsewhere_finishes_it_at_once(fleet: Fleet):
    """a2 is killed in a run of min_members 3 and comes back after a0 and a1 have finished it:
    it resumes from its checkpoint, sees most members report the run finished, and records it
    finished at once.  Found in the field lab: a gateway killed at round 285 of 300 waited its
    whole start_timeout for members that would never accept the run again, then failed it."""
    rid = fleet.submit("--algorithm", "fedavg", "--rounds", "8", "--min-members", "3", "--start-timeout", "300",
                       "--option", "round_timeout=4", "--training", "steps=100")
    fleet.wait(lambda: len(fleet.trained("a2", rid)) >= 3, 180, "a2 at round 3")
    procs = fleet.procs
    procs["a2"].send_signal(signal.SIGKILL)
    procs["a2"].wait(timeout=30)
    # what it trained before the kill: its round records, and the newest checkpoint's round (a record
    # still pending when the kill came is saved with that checkpoint and written when the run resumes)
    saved = [int(c.stem.split("-")[1]) for c in (fleet.tmp / "a2" / "runs" / rid / "checkpoints").glob("round-*.json")]
    trained = max([r["round"] for r in fleet.trained("a2", rid)] + saved)
    fleet.wait(lambda: all(fleet.run_states(rid).get(n, {}).get("state") == "finished" for n in ("a0", "a1")), 180,
               "a0 and a1 finish without a2")
    t0 = time.monotonic()
    procs["a2"] = _start(fleet.tmp, "a2", fleet.paths["a2"])
    fleet.wait(lambda: fleet.run_states(rid).get("a2", {}).get("state") == "finished", 90, "a2 records it finished")
    assert time.monotonic() - t0 < 90  # not its start_timeout (300 s), and not failed
    assert max(r["round"] for r in fleet.trained("a2", rid)) == trained  # no round alone after its return
    assert "most of the run's members report it finished" in (fleet.tmp / "a2.log").read_text()
    fleet.wait(fleet.all_idle, 60, "idle after the run")


def test_profile_disallowed_algorithm_is_declined_while_others_run_it(fleet: Fleet):
    rid = fleet.submit("--algorithm", "cfa", "--rounds", "2", "--option", "round_timeout=10")
    for answer in ("a0: accepted", "a1: accepted", "a2: declined: algorithm cfa not allowed by profile generic-x86"):
        assert f"  {answer}\n" in fleet.said + "\n", fleet.said  # run submit's answers (exit 0: two accepted)
    fleet.wait(lambda: {n: r.get("state") for n, r in fleet.run_states(rid).items()}
               == {"a0": "finished", "a1": "finished", "a2": "declined"}, 180, "a0, a1 finish; a2 declines")
    show = json.loads(dflctl("run", "show", rid, *fleet.b, "--json"))
    assert show["nodes"]["a2"]["reason"] == "algorithm cfa not allowed by profile generic-x86"
    assert not fleet.metrics("a2", rid)
    for n in ("a0", "a1"):
        assert [r["round"] for r in fleet.trained(n, rid)] == [1, 2]
    assert {x for r in fleet.trained("a0", rid) for x in r["neighbour_ids"]} == {"a1"}
    for n in ("a0", "a1"):  # they did not wait discovery.start_timeout for a2, which declined
        assert "waiting for 1 peers, not discovery.min_peers 2: the others declined the run" in \
            (fleet.tmp / f"{n}.log").read_text()
    fleet.wait(fleet.all_idle, 60, "idle after the declined run")


def test_killed_agent_rejoins_its_run_and_cancel_stops_within_a_round(fleet: Fleet):
    # slow enough to rejoin, and long enough to be cancelled (rounds take well under a second now:
    # at 60 rounds the run once finished before the cancel was sent)
    rid = fleet.submit("--algorithm", "fedavg", "--rounds", "400", "--option", "round_timeout=20",
                       "--training", "steps=200")
    fleet.wait(lambda: len(fleet.run_states(rid)) == 3
               and all(r.get("round", 0) >= 3 for r in fleet.run_states(rid).values()), 180, "round 3 everywhere")
    procs = fleet.procs
    procs["a2"].send_signal(signal.SIGKILL)
    procs["a2"].wait(timeout=30)
    killed_at = max(r["round"] for r in fleet.trained("a2", rid))
    n_before = len(fleet.metrics("a2", rid))
    procs["a2"] = _start(fleet.tmp, "a2", fleet.paths["a2"])

    def rejoined() -> list[dict]:
        return [r for r in fleet.metrics("a2", rid)[n_before:] if r.get("neighbour_ids")]

    fleet.wait(lambda: len(rejoined()) >= 2, 180, "a2 training with its neighbours again")
    log2 = (fleet.tmp / "a2.log").read_text()
    assert f"resumed from checkpoint of round {killed_at}" in log2 or \
        f"resumed from checkpoint of round {killed_at - 1}" in log2  # its run's checkpoint
    assert (fleet.tmp / "a2" / "runs" / rid / "checkpoints").is_dir()
    first = rejoined()[0]
    fed_round = max(r["round"] for r in fleet.trained("a0", rid))
    assert first["round"] > killed_at  # never restarted at round 1
    assert set(first["neighbour_ids"]) == {"a0", "a1"} and first["round"] >= fed_round - 3  # rejoined them
    # an unsigned cancel is not sent to agents that require signed runs
    r = run_dflctl("run", "cancel", rid, *fleet.b)
    assert r.returncode == 2 and "nothing was sent: give --operator-dir" in r.stderr, r.stderr
    assert fetch_retained(fleet.broker, cancel_topic(fleet.fed, rid), absent_after=0.5) is None
    # cancel: every member stops within one round of the round it had completed when the cancel reached it
    dflctl("run", "cancel", rid, *fleet.b, "--operator-dir", str(fleet.operator))
    fleet.wait(lambda: {n: r.get("state") for n, r in fleet.run_states(rid).items()}
               == {n: "cancelled" for n in IDS}, 90, "cancelled everywhere")
    show = json.loads(dflctl("run", "show", rid, *fleet.b, "--json"))
    assert show["state"] == "cancelled"
    for n in IDS:
        at_cancel = show["nodes"][n]["round"]  # the last round completed when the cancel arrived
        last = max(r["round"] for r in fleet.trained(n, rid))
        assert at_cancel >= 3 and at_cancel <= last <= at_cancel + 1, (n, at_cancel, last)
        assert f"run {rid} cancelled by the operator: the cancel arrived after round {at_cancel}" in \
            (fleet.tmp / f"{n}.log").read_text()
    assert max(r["round"] for r in fleet.trained("a0", rid)) < 400  # it did not run to its end
    fleet.wait(fleet.all_idle, 60, "idle after the cancel")
    assert all(p.poll() is None for p in procs.values())
