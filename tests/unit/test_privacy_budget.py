"""The privacy ledger and admission against the lifetime budget (real SQLite, a real sample store).

The ledger reserves a run's planned spend at admission and settles it with the steps taken; its
composed ε agrees with Opacus's RDPAccountant after the ledger is reopened from disk; a run that
would go past ``privacy.lifetime_epsilon`` is declined with a one-line reason; admission loads no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dfl_agent.privacy.accountant import rdp_epsilon
from dfl_agent.privacy.plan import RunPlan
from dfl_agent.runtime.service.privacy_budget import PrivacyBudget
from dfl_agent.runtime.service.supervisor import RunProgress
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger, deployment_privacy


def _plan(sigma: float, q: float, steps: int) -> RunPlan:
    return RunPlan(noise_multiplier=sigma, sample_rate=q, steps=steps, epsilon=rdp_epsilon([(sigma, q, steps)], 1e-5),
                   delta=1e-5, max_grad_norm=1.0)


def test_ledger_reserves_settles_and_survives_a_reopen(tmp_path: Path) -> None:
    led = PrivacyLedger(tmp_path)
    led.reserve("r1", _plan(1.1, 0.01, 1000), rounds=10)
    led.reserve("r1", _plan(5.0, 0.5, 1), rounds=1)  # a restart admits it again: the reservation stands
    led.reserve("r2", _plan(0.8, 0.05, 300), rounds=3)
    led.reserve("r3", _plan(2.0, 0.2, 50), rounds=5)
    assert [e["state"] for e in led.entries()] == ["reserved"] * 3
    led.mark_trained("r1")
    assert led.settle("r1", 1000)["state"] == "spent"
    assert led.settle("r3", 0)["state"] == "released"  # never trained: nothing spent
    assert led.settle("r1", 10)["steps"] == 1000  # settled once
    again = PrivacyLedger(tmp_path)  # the agent restarted: the same history from disk
    assert again.history() == [(1.1, 0.01, 1000), (0.8, 0.05, 300)]  # the reservation of r2 counts
    assert again.epsilon(1e-5) == pytest.approx(rdp_epsilon([(1.1, 0.01, 1000), (0.8, 0.05, 300)], 1e-5))
    pytest.importorskip("opacus")
    import warnings

    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(again.history())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert again.epsilon(1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=0.01)


def _store_cfg(tmp_path: Path, privacy: dict, n: int = 400, rounds: int = 5):
    from dfl_agent.runtime.shared.sample_store import open_store

    cfg = config_from_dict({"state_dir": str(tmp_path), "algorithm": {"name": "local", "rounds": rounds},
                            "training": {"batch_size": 20, "steps": 4},
                            "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2}, "privacy": privacy})
    store = open_store(cfg)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(n, 3, 4)).astype(np.float32), y=rng.integers(0, 2, n))
    store.ingest_file(tmp_path / "a.npz")
    return cfg, store


def _run(rid: str, rounds: int = 5) -> RunDescriptor:
    return RunDescriptor(run_id=rid, federation="default", algorithm="local", rounds=rounds)


def test_admission_reserves_then_declines_past_the_lifetime_budget(tmp_path: Path) -> None:
    from dfl_agent.profiles import get_profile

    cfg, store = _store_cfg(tmp_path, {"lifetime_epsilon": 3.0, "dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}})
    budget = PrivacyBudget(cfg, get_profile("generic-x86"), store)
    from dfl_agent.store.sqlite import validation_mask

    n_train = int((~validation_mask(store.snapshot(), cfg.data.validation_share)).sum())
    assert budget.admit(_run("a")) is None
    row = budget.ledger.get("a")
    assert (row["state"], row["steps"], row["sample_rate"]) == ("reserved", 20, pytest.approx(20 / n_train))
    assert budget.on_state("a", "admitted", tmp_path)["privacy"]["state"] == "reserved"
    # the run trained 5 rounds of 4 DP steps: settled with what its round records say
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": t, "dp_steps": 4}) + "\n" for t in range(1, 6)))
    budget.on_state("a", "training", run_dir)
    view = budget.on_state("a", "finished", run_dir)["privacy"]
    assert view["state"] == "spent" and view["steps"] == 20 and view["epsilon"] == pytest.approx(row["epsilon"], rel=1e-3)
    spent = budget.status()["epsilon_spent"]
    m = deployment_privacy(cfg, tmp_path, "a")  # the deployment manifest's field
    assert m["epsilon_run"] == view["epsilon"] and m["epsilon_lifetime"] == pytest.approx(spent, abs=1e-3)
    assert (m["lifetime_epsilon"], m["delta"], m["steps"]) == (3.0, 1e-5, 20)
    assert 0 < spent < 3.0 and budget.status()["epsilon_remaining"] == pytest.approx(3.0 - spent, abs=1e-3)
    # runs until the next one would go past 3.0: then a one-line reason, and nothing reserved
    reasons = [budget.admit(_run(f"r{i}")) for i in range(12)]
    declined = [r for r in reasons if r]
    assert declined and declined[0].startswith("privacy budget: the run would spend epsilon ") and "\n" not in declined[0]
    assert "past privacy.lifetime_epsilon 3" in declined[0]
    assert "sampling rate" not in declined[0] and "steps" not in declined[0]  # published: nothing that reveals N
    assert budget.ledger.get(f"r{reasons.index(declined[0])}") is None
    assert budget.ledger.epsilon(1e-5) <= 3.0


def test_a_run_that_ended_early_or_never_trained(tmp_path: Path) -> None:
    from dfl_agent.profiles import get_profile

    cfg, store = _store_cfg(tmp_path, {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}})
    budget = PrivacyBudget(cfg, get_profile("generic-x86"), store)
    for rid in ("never", "cancel", "silent"):
        assert budget.admit(_run(rid)) is None
    budget.on_state("never", "failed", tmp_path / "runs" / "never")  # start_timeout: never trained
    assert budget.ledger.get("never")["state"] == "released"
    d = tmp_path / "runs" / "cancel"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"round": 1, "dp_steps": 4}) + "\n")
    budget.on_state("cancel", "training", d)
    assert budget.on_state("cancel", "cancelled", d)["privacy"]["steps"] == 8  # + one round maybe sent
    budget.on_state("silent", "training", tmp_path)
    assert budget.on_state("silent", "failed", tmp_path / "runs" / "silent")["privacy"]["steps"] == 20  # the plan


def test_delta_not_below_one_over_n_is_declined(tmp_path: Path) -> None:
    from dfl_agent.profiles import get_profile

    cfg, store = _store_cfg(tmp_path, {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "delta": 0.05}}, n=60)
    reason = PrivacyBudget(cfg, get_profile("generic-x86"), store).admit(_run("a"))
    assert reason == "privacy: privacy.dp.delta: 0.05 is not below 1/N for this device's training samples"
    from dfl_agent.runtime.service.privacy_budget import public_reason

    assert public_reason("privacy.dp.target_epsilon: no noise multiplier up to 1000 keeps the run's epsilon at or "
                         "below 0.01 (100 steps at sampling rate 0.1, delta 1e-05)") == \
        "privacy.dp.target_epsilon: no noise multiplier up to 1000 keeps the run's epsilon at or below 0.01"


def test_no_dp_admits_and_shows_off(tmp_path: Path) -> None:
    from dfl_agent.cli.tables import privacy_text
    from dfl_agent.profiles import get_profile

    cfg, store = _store_cfg(tmp_path, {})
    budget = PrivacyBudget(cfg, get_profile("generic-x86"), store)
    assert budget.admit(_run("a")) is None and budget.ledger.entries() == []
    assert budget.status() == {"dp": False} and privacy_text(budget.status()) == "off"
    assert privacy_text({"dp": True, "epsilon_spent": 9.5, "epsilon_remaining": 0.5, "lifetime_epsilon": 10.0}) \
        == "eps 9.5/10 (0.5 left)"
    assert privacy_text(None) == ""
    assert deployment_privacy(cfg, tmp_path, "a") is None


def test_admission_loads_no_torch(tmp_path: Path) -> None:
    """The supervisor is torch-free: the whole admission (profile and memory check, then the
    privacy plan and the reservation) runs without importing torch."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_privacy_budget import _run, _store_cfg
        from dfl_agent.profiles import get_profile
        from dfl_agent.runtime.service.admission import admit
        from dfl_agent.runtime.service.privacy_budget import PrivacyBudget
        cfg, store = _store_cfg(Path({str(tmp_path)!r}), {{"dp": {{"max_grad_norm": 1.0, "target_epsilon": 2.0}}}})
        profile = get_profile("generic-x86")
        d = _run("a")
        assert admit(d, profile, node_id="n", input_shape=[3, 128], num_classes=2) is None
        assert PrivacyBudget(cfg, profile, store).admit(d) is None
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "opacus"))))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
    assert PrivacyLedger(tmp_path).get("a")["state"] == "reserved"


class _OnceAgent:
    """The run process of ``--once``'s run, cut to what the privacy budget sees: it appends five
    round records of 4 DP steps each to the node's metrics file and finishes."""

    def __init__(self, cfg, config_path, *, on_state, **kw):
        self.cfg, self.on_state = cfg, on_state
        self.outcome, self.snapshot, self.data_shape, self.crash, self.error = "starting", None, None, None, ""
        self.progress = RunProgress("n", "f", {"round": 5})

    async def run(self, stop):
        with (Path(self.cfg.state_dir) / "metrics.jsonl").open("a") as f:
            f.write("".join(json.dumps({"round": t, "dp_steps": 4}) + "\n" for t in range(1, 6)))
        self.outcome = "finished"
        self.on_state("trained")
        return 0


def test_run_once_is_admitted_reserved_and_settled(tmp_path: Path) -> None:
    """``dfl-agent run --once`` goes through the run manager (a queue of one run): admission
    reserves its plan (or declines it: exit code 2), and the ledger settles it from the records
    it appended to the node's metrics file."""
    import asyncio

    from dfl_agent.runtime.service.run_manager import build_run_manager
    from dfl_agent.runtime.shared.assembly import StartupError

    cfg, store = _store_cfg(tmp_path, {"lifetime_epsilon": 6.0, "dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}})
    store.close()
    cfg.model.spec = {"type": "mlp", "input_shape": [3, 4], "hidden": [8], "num_classes": 2}  # fits the (3, 4) windows
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"round": 9, "dp_steps": 99}) + "\n")  # an earlier run's record

    def once() -> str:
        m = build_run_manager(cfg, None, once=True, agent_factory=_OnceAgent)
        assert asyncio.run(m.run_once(asyncio.Event())) == 0
        (rid,) = [r for r in m.ledger.entries if r not in seen]
        seen.add(rid)
        return rid

    seen: set[str] = set()
    rid = once()
    row = PrivacyLedger(tmp_path).get(rid)
    assert (row["state"], row["steps"]) == ("spent", 20)
    with pytest.raises(StartupError, match=r"^run \S+ declined: privacy budget: the run would spend"):
        for _ in range(2, 9):
            time.sleep(1.0)  # --once's run ids are its start's second
            once()
    off = config_from_dict({"state_dir": str(tmp_path / "off"), "algorithm": {"name": "local", "rounds": 5},
                            "data": {"dataset": "digits"}})
    assert asyncio.run(build_run_manager(off, None, once=True, agent_factory=_OnceAgent).run_once(asyncio.Event())) == 0
    assert not (tmp_path / "off" / "privacy").exists()  # no DP: nothing opened, nothing written


@pytest.mark.parametrize("at", ["admitted:after", "training:after", "trained:after", "recorded:before"])
def test_a_crash_mid_run_never_under_counts(tmp_path: Path, at: str) -> None:
    """The run manager with DP, killed at a state boundary (the crash switch), then restarted over
    the same state folder: the reservation is in the ledger before the run is admitted, stands
    through the crash, and the run is settled once (its rounds report no ``dp_steps`` here: the
    plan's steps)."""
    import asyncio

    from dfl_agent.runtime.shared.descriptor import RunDescriptor as Run
    from tests.unit import test_run_crash as rc
    from tests.unit.test_run_manager import manager

    def make():
        m = manager(tmp_path, agent=rc.DeployingAgent, deploy={"tolerance": 0.0, "onnx": False},
                    data={"dataset": "digits", "partition": "iid", "num_nodes": 4},
                    privacy={"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}})
        m.lobby, m.has_default = rc.MembersLobby(), False
        return m

    crashes = {"at": at}

    def point(state, when):
        if crashes["at"] == f"{state}:{when}":
            raise rc.Crash(at)

    d = Run(run_id="r1", federation="f", algorithm="fedavg", rounds=2, min_members=2)
    with pytest.MonkeyPatch.context() as mp:
        import dfl_agent.runtime.service.run_manager as rm

        mp.setattr(rm, "crash_point", point)
        m = make()
        m.lobby.queue.offer(d)
        with pytest.raises(rc.Crash):
            asyncio.run(rc._serve_until_done(m, "r1"))
        row = PrivacyLedger(tmp_path).get("r1")
        assert row["state"] == "reserved" and row["steps"] == row["planned_steps"] > 0  # reserved before the crash
        crashes["at"] = None
        m = make()  # the restart
        m.lobby.queue.offer(d)
        asyncio.run(rc._serve_until_done(m, "r1"))
    rows = PrivacyLedger(tmp_path).entries()
    assert [(r["run_id"], r["state"], r["steps"]) for r in rows] == [("r1", "spent", row["planned_steps"])]
    assert m.ledger.entries["r1"]["privacy"]["epsilon"] == pytest.approx(row["epsilon"], rel=1e-3)
    assert m.privacy.status()["epsilon_spent"] == pytest.approx(row["epsilon"], rel=1e-3)


def test_run_once_counts_spool_files_that_are_still_settling(tmp_path: Path) -> None:
    """A spool file younger than the store's settle time is left for a later pass, but the run
    finds it: ``run --once`` admitted right after the feed dropped its files (N = 0 then)
    declined with "no samples to train on". It waits for them to settle and counts them."""
    import asyncio

    from dfl_agent.runtime.service.run_manager import build_run_manager
    from tests.system.test_store_agent import SHAPE, drop

    cfg = config_from_dict({
        "federation": "f", "node_id": "dev1", "state_dir": str(tmp_path), "algorithm": {"name": "local", "rounds": 2},
        "data": {"dataset": "store", "input_shape": list(SHAPE), "num_classes": 4}, "model": {"size": "small"},
        "privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}},
    })
    for i in range(3):
        drop(tmp_path / "spool", f"a{i}.npz", 60, i)  # just written: younger than the settle time
    m = build_run_manager(cfg, None, once=True, agent_factory=_OnceAgent)
    assert asyncio.run(m.run_once(asyncio.Event())) == 0  # before: "... no samples to train on (N = 0)"
    (row,) = PrivacyLedger(tmp_path).entries()
    assert row["state"] == "spent" and 0 < row["sample_rate"] < 1

@pytest.mark.parametrize("privacy, profile_privacy", [
    ({"lifetime_epsilon": 10.0, "dp": {"max_grad_norm": 1.0, "target_epsilon": 12.0}}, None),
    ({"dp": {"max_grad_norm": 1.0, "target_epsilon": 5.0}}, {"lifetime_epsilon": 4.0}),  # the profile's budget
])
def test_check_config_refuses_a_target_epsilon_above_the_lifetime_budget(tmp_path: Path, capsys, privacy,
                                                                         profile_privacy) -> None:
    """A per-run target ε above the lifetime budget: every run would be declined at admission,
    so check-config (and run) exit 2 naming the key, in the admission's own words."""
    import tomli_w

    from dfl_agent.privacy.config import DPConfig, PrivacyConfig
    from dfl_agent.profiles import get_profile
    from dfl_agent.runtime.service.daemon import main

    raw = {"federation": "f", "state_dir": str(tmp_path / "state"), "algorithm": {"name": "local", "rounds": 5},
           "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2}, "privacy": privacy}
    if profile_privacy:
        raw["profile_overrides"] = {"privacy": profile_privacy}
    path = tmp_path / "node.toml"
    path.write_text(tomli_w.dumps(raw))
    assert main(["check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "privacy.dp.target_epsilon: " in err and "every run would be declined" in err, err
    assert not (tmp_path / "state").exists()
    # admission applies the same rule, and says the same
    cfg, store = _store_cfg(tmp_path, {"dp": {"max_grad_norm": 1.0, "target_epsilon": 2.0}})
    budget = PrivacyBudget(cfg, get_profile("generic-x86"), store)
    life = profile_privacy["lifetime_epsilon"] if profile_privacy else privacy["lifetime_epsilon"]
    budget.config = PrivacyConfig(DPConfig(max_grad_norm=1.0, target_epsilon=privacy["dp"]["target_epsilon"]), life)
    reason = budget.admit(_run("a"))
    assert reason is not None and reason.startswith("privacy budget: privacy.dp.target_epsilon: ")
    assert reason.removeprefix("privacy budget: ") in err and budget.ledger.get("a") is None
    # at the budget, check-config passes (a first run can fit)
    raw["privacy"] = {"lifetime_epsilon": 5.0, "dp": {"max_grad_norm": 1.0, "target_epsilon": 5.0}}
    raw.pop("profile_overrides", None)
    path.write_text(tomli_w.dumps(raw))
    assert main(["check-config", "--config", str(path)]) == 0
