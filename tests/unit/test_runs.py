"""Runs (dfl_agent.runtime.shared.descriptor, ledger, lobby, admission): queue order, recurrence, the ledger across restarts,
who may submit, descriptor precedence over node.toml."""

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.durations import parse_duration
from dfl_agent.runtime.service.admission import admit
from dfl_agent.runtime.service.default_run import default_descriptor
from dfl_agent.runtime.service.ledger import RunLedger
from dfl_agent.runtime.service.lobby import RunQueue
from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.descriptor import (
    RunDescriptor,
    RunVerifier,
    operator_certificate,
    period_index,
    recurring_run_id,
    sign_descriptor,
)
from dfl_agent.security.keys import issue_certificate, public_key_b64


def d(rid, t, **kw):
    return RunDescriptor(run_id=rid, federation="f", algorithm="fedavg", rounds=2, submitted_at=t, **kw)


def test_queue_orders_by_signed_submitted_at_then_run_id_not_arrival():
    q = RunQueue()
    for x in (d("r-c", 30.0), d("r-b", 10.0), d("r-a", 10.0), d("r-0", 20.0, cancelled=True)):
        q.offer(x)
    assert [r.run_id for r in q.ordered()] == ["r-a", "r-b", "r-0", "r-c"]
    done = {"r-a"}
    assert q.next_runnable(done.__contains__).run_id == "r-b"
    done.add("r-b")
    assert q.next_runnable(done.__contains__).run_id == "r-c"  # the cancelled one is skipped
    assert q.next_runnable(lambda r: True) is None


def test_queue_keeps_newest_seq_and_start_time_delays():
    q = RunQueue()
    assert q.offer(d("r-1", 1.0, seq=2, cancelled=True))
    assert not q.offer(d("r-1", 1.0, seq=1))  # an older copy (replayed) does not un-cancel it
    assert q.runs["r-1"].cancelled
    q.offer(d("r-2", 2.0, start_at=1000.0))
    assert q.next_runnable(lambda r: False, now=999.0) is None
    assert q.next_runnable(lambda r: False, now=1001.0).run_id == "r-2"


def next_recurring(ledger: RunLedger, default_id: str, every_s: float, now: float,
                   running: str | None = None) -> str | None:
    """The repeat of a recurring default run that is due at ``now``, or None.

    A recurring run never overlaps itself: while one of its repeats is ``running``
    nothing is due, and a period whose repeat already ran (or any later one) is not
    due again.  Missed periods are not made up: only the current period's repeat runs.
    """
    if running is not None and running.startswith(default_id + "."):
        return None
    rid = recurring_run_id(default_id, period_index(now, every_s))
    return None if ledger.is_done(rid) else rid


def test_recurring_default_run_never_overlaps_itself_and_ids_follow_periods(tmp_path):
    every = parse_duration("6h")
    assert every == 21600 and parse_duration("90s") == 90 and parse_duration("15m") == 900
    with pytest.raises(ValueError):
        parse_duration("6 weeks")
    ledger = RunLedger(tmp_path)
    t0 = 10 * every + 5
    first = next_recurring(ledger, "d-x", every, t0)
    assert first == recurring_run_id("d-x", 10) == "d-x.10"
    assert next_recurring(ledger, "d-x", every, t0 + every, running=first) is None  # still running: no overlap
    ledger.set(first, "finished", 3)
    assert next_recurring(ledger, "d-x", every, t0 + 60) is None  # same period: not again
    assert next_recurring(ledger, "d-x", every, t0 + every) == "d-x.11"


def test_finished_run_is_not_rerun_after_restart(tmp_path):
    cfg = config_from_dict({"federation": "f", "state_dir": str(tmp_path), "algorithm": {"rounds": 3}})
    a = default_descriptor(cfg)
    assert a.run_id.startswith("d-") and a.default
    assert default_descriptor(cfg).run_id == a.run_id  # a hash of federation + settings: stable across boots
    other = config_from_dict({"federation": "f", "state_dir": str(tmp_path), "algorithm": {"rounds": 4}})
    assert default_descriptor(other).run_id != a.run_id
    RunLedger(tmp_path).set(a.run_id, "finished", 3)
    again = RunLedger(tmp_path)  # a "reboot": the ledger is read back from disk
    assert again.is_done(a.run_id) and again.entries[a.run_id]["round"] == 3
    import sqlite3

    with sqlite3.connect(tmp_path / "runs" / "ledger.sqlite") as con:  # on disk, in the ledger's own file
        state, entry = con.execute("SELECT state, entry FROM runs WHERE run_id = ?", (a.run_id,)).fetchone()
    assert state == "finished" and json.loads(entry)["round"] == 3


def test_config_without_algorithm_section_has_no_default_run(tmp_path):
    cfg = config_from_dict({"federation": "f", "state_dir": str(tmp_path)})
    assert cfg.has_default_run is False
    assert config_from_dict({"algorithm": {"every": "6h"}}).has_default_run is True
    assert config_from_dict({"runtime": {"rejoin": False}}).runtime.rejoin is True  # deprecated, always on
    with pytest.raises(ValueError, match="algorithm.every"):
        config_from_dict({"algorithm": {"every": "soon"}})
    cfg = config_from_dict({"algorithm": {"every": "1h"}})
    assert default_descriptor(cfg, now=7200.5).run_id.endswith(".2")


def _verifier(fed_key, **kw):
    return RunVerifier("f", require_signatures=True, federation_key=public_key_b64(fed_key), **kw)


def test_only_an_operator_may_submit_when_signatures_are_required():
    import dataclasses

    from dfl_agent.security.trust import SeqCounter

    fed_key, op, dev, stranger = (Ed25519PrivateKey.generate() for _ in range(4))
    run = d("r-1", 1.0)
    op_cert = operator_certificate(fed_key, "f", "alice", public_key_b64(op))
    dev_cert = issue_certificate(fed_key, "f", "n-1", public_key_b64(dev))
    v = _verifier(fed_key)
    signed = sign_descriptor(run, op, "alice", op_cert)
    env = json.loads(signed)  # the control envelope of presence/status, one kind per run
    assert (env["ctl"], env["kind"], env["sender"], env["payload"]["run_id"]) == (1, "run:r-1", "alice", "r-1")
    assert v.check(signed)[0] == dataclasses.replace(run, submitter="alice")  # the verified sender submitted it
    assert v.check(sign_descriptor(run, dev, "n-1", dev_cert)) == (None, "not_operator")
    assert v.check(sign_descriptor(run, stranger, "eve")) == (None, "unknown_key")
    assert v.check(sign_descriptor(run, None)) == (None, "unsigned")
    forged = json.loads(sign_descriptor(run, op, "alice", op_cert))
    forged["payload"]["rounds"] = 99
    assert v.check(json.dumps(forged).encode()) == (None, "bad_signature")
    # a self-made "operator" certificate not signed by the federation key
    fake = operator_certificate(Ed25519PrivateKey.generate(), "f", "eve", public_key_b64(stranger))
    assert v.check(sign_descriptor(run, stranger, "eve", fake)) == (None, "unknown_key")
    assert v.check(b"{nonsense") == (None, "malformed")
    other_fed = RunDescriptor("r-2", "g", "fedavg", 1)
    assert v.check(sign_descriptor(other_fed, op, "alice", op_cert)) == (None, "wrong_federation")
    # replay: per (sender, run) sequence numbers, as for presence and status
    assert v.check(signed) == (None, "duplicate")  # the same retained message again: ignored, not counted
    seq = SeqCounter(None)
    older = sign_descriptor(run, op, "alice", op_cert, seq=seq)
    cancel = sign_descriptor(dataclasses.replace(run, cancelled=True, seq=1), op, "alice", op_cert, seq=seq)
    assert v.check(cancel)[0].cancelled
    assert v.check(older) == (None, "replay")  # an older copy of the same run never un-cancels it
    # ... while another run's descriptor with a lower number (retained, any arrival order) is fine
    assert v.check(sign_descriptor(d("r-0", 0.5), op, "alice", op_cert, seq=SeqCounter(None)))[0].run_id == "r-0"
    assert v.refused == {"not_operator": 1, "unknown_key": 2, "unsigned": 1, "bad_signature": 1, "malformed": 1,
                         "wrong_federation": 1, "replay": 1}
    # pinned operator keys (security.operators) work without a certificate
    pinned = _verifier(fed_key, operators={"bob": public_key_b64(stranger)})
    assert pinned.check(sign_descriptor(run, stranger, "bob"))[0].submitter == "bob"
    # lab use: anyone may submit
    assert RunVerifier("f", require_signatures=False).check(sign_descriptor(run, None))[0] == run


def test_admit_declines_with_the_reason():
    from dfl_agent.profiles import resolve_profile

    prof = resolve_profile("generic-x86", {"behaviour": {"algorithms": ["fedavg"]}})[0]
    assert admit(d("r", 1.0), prof, node_id="n") is None
    dechw = RunDescriptor(run_id="r", federation="f", algorithm="dechw", rounds=1)
    assert admit(dechw, prof, node_id="n") == "algorithm dechw not allowed by profile generic-x86"
    assert "memory_budget_mb" in admit(d("r", 1.0), prof, node_id="n", model_params=10**9)
    assert "unknown algorithm" in admit(RunDescriptor("r", "f", "nope", 1), prof, node_id="n")


def test_descriptor_overrides_node_toml_and_members():
    from dfl_agent.runtime.service.run_manager import StartupError, run_config_for

    cfg = config_from_dict({"training": {"lr": 0.1}, "algorithm": {"rounds": 5}})
    run = RunDescriptor(run_id="r", federation="default", algorithm="dechw", rounds=2, options={"round_timeout": 3},
                        training={"lr": 0.5}, model={"size": "small"})
    new = run_config_for(cfg, run)
    assert (new.algorithm.name, new.algorithm.rounds, new.training.lr, new.model.size) == ("dechw", 2, 0.5, "small")
    assert cfg.training.lr == 0.1  # the node's own config is untouched
    with pytest.raises(StartupError, match="training.nope"):
        run_config_for(cfg, RunDescriptor("r", "default", "fedavg", 1, training={"nope": 1}))
    assert d("r", 1, members=["a"]).is_for("a", "x") and not d("r", 1, members=["a"]).is_for("b", "x")
    assert d("r", 1, members={"profile": ["pi"]}).is_for("b", "pi")
    with pytest.raises(ValueError):
        RunDescriptor.from_dict({"run_id": "bad id!", "federation": "f", "algorithm": "a", "rounds": 1})


def test_admit_counts_the_models_parameters_against_memory_budget_mb():
    from dfl_agent.models import build_model, count_trainable, default_spec
    from dfl_agent.models import param_count as spec_params
    from dfl_agent.profiles import resolve_profile
    from dfl_agent.runtime.service.admission import run_model_params

    spec = default_spec([9, 128], 6, "medium")
    assert spec_params(spec) == count_trainable(build_model(spec))  # counted on the meta device, same figure
    roomy = resolve_profile("generic-x86", {"compute": {"memory_budget_mb": 1024}})[0]
    tight = resolve_profile("generic-x86", {"compute": {"memory_budget_mb": 70}})[0]
    small = d("r", 1.0)  # fedavg, the default model for HAR windows: ~14k parameters, a few MiB
    assert admit(small, tight, node_id="n", input_shape=[9, 128], num_classes=6) is None
    # a big spec (~21M parameters, ~80 MiB a copy) is counted without allocating it, and declined with the figure
    huge = RunDescriptor("r", "f", "fedavg", 1, model={"spec": {"type": "mlp", "input_shape": [9, 128],
                                                                "hidden": [4096, 4096], "num_classes": 6}})
    phi, source = run_model_params(huge, roomy)
    assert phi == 9 * 128 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 6 + 6 and source == "the run's model spec"
    assert admit(huge, roomy, node_id="n") is None  # fedavg: 7 copies (own 3 + 4 neighbours'), ~639 MiB
    mid = resolve_profile("generic-x86", {"compute": {"memory_budget_mb": 200}})[0]
    reason = admit(huge, mid, node_id="n")
    assert reason.startswith("model too large for memory_budget_mb") and str(phi) in reason and "200 MiB" in reason
    # a size tier or family is built for the data's shape; without a shape the tier's reference model counts
    large = RunDescriptor("r", "f", "fedavg", 1, model={"size": "large"})
    assert run_model_params(large, roomy, input_shape=[9, 128], num_classes=6) == \
        (spec_params(default_spec([9, 128], 6, "large")), "default large model")
    assert run_model_params(large, roomy)[1] == "reference large model"
    fam = RunDescriptor("r", "f", "heterofl", 1, model={"family": "H1", "size": "large"})
    assert run_model_params(fam, roomy, input_shape=[9, 128], num_classes=6)[1] == "H1 member for large"
    # the node's own [model] counts when the run names none
    assert run_model_params(small, roomy, node_model={"spec": huge.model["spec"]})[0] == phi
    assert "invalid model" in admit(RunDescriptor("r", "f", "fedavg", 1, model={"spec": {"type": "?"}}), roomy,
                                    node_id="n")


def test_run_model_family_reaches_the_model_build():
    from dfl_agent.models.families import FAMILIES, family_member, family_specs
    from dfl_agent.runtime.service.run_manager import StartupError, run_config_for
    from dfl_agent.runtime.shared.assembly import model_spec_for
    from dfl_agent.runtime.shared.config import MODEL_FAMILIES, ConfigError

    assert tuple(FAMILIES) == MODEL_FAMILIES
    cfg = config_from_dict({"model": {"size": "small"}, "algorithm": {"rounds": 5}})
    run = RunDescriptor(run_id="r", federation="default", algorithm="heterofl", rounds=2, model={"family": "H1"})
    new = run_config_for(cfg, run)  # was: "model.family: unknown key"
    assert (new.model.family, new.model.size, new.model.spec) == ("H1", None, None)  # replaces [model] whole
    h1 = family_specs("H1", [9, 128], 6)
    assert model_spec_for(new, "heterofl", [9, 128], 6, profile_size="medium") == h1[1]
    assert model_spec_for(new, "heterofl", [9, 128], 6, profile_size="large") == h1[0]
    assert family_member("H0", [1, 8, 8], 10, "small") == family_specs("H0", [1, 8, 8], 10)[0]  # one member
    sized = run_config_for(cfg, RunDescriptor("r", "default", "fedavg", 1, model={"family": "H2", "size": "small"}))
    assert model_spec_for(sized, "fedavg", [1, 8, 8], 10, profile_size="large") == family_specs("H2", [1, 8, 8], 10)[2]
    with pytest.raises(StartupError, match="model.family: must be one of"):
        run_config_for(cfg, RunDescriptor("r", "default", "fedavg", 1, model={"family": "H9"}))
    with pytest.raises(StartupError, match="training.lr: expected float"):
        run_config_for(cfg, RunDescriptor("r", "default", "fedavg", 1, training={"lr": "fast"}))
    with pytest.raises(ConfigError, match="model.family"):
        config_from_dict({"model": {"family": "H1", "spec": {"type": "mlp"}}})


def test_default_run_recurs_when_k_new_samples_arrived_and_never_overlaps(tmp_path):
    import numpy as np

    from dfl_agent.runtime.service.default_run import next_sample_triggered
    from dfl_agent.runtime.shared.config import ConfigError
    from dfl_agent.runtime.shared.descriptor import sample_run_id
    from dfl_agent.runtime.shared.sample_store import open_store

    cfg = config_from_dict({"state_dir": str(tmp_path), "algorithm": {"rounds": 2, "every_samples": 50},
                            "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2}})
    store = open_store(cfg)

    def drop(name: str, n: int) -> None:
        rng = np.random.default_rng([ord(name[0]), n])
        np.savez(tmp_path / name, x=rng.normal(size=(n, 3, 4)).astype(np.float32), y=rng.integers(0, 2, n))
        assert store.ingest_file(tmp_path / name)["samples"] == n

    drop("a.npz", 30)
    ledger = RunLedger(tmp_path)
    first = default_descriptor(cfg, ledger=ledger, new_samples=store.count_since)
    assert first is not None and first.run_id.endswith(".s0") and first.default  # the first run: at once
    base = first.run_id[:-3]
    # while a repeat runs nothing else is due (never overlaps itself), even with many new samples
    drop("b.npz", 80)
    assert next_sample_triggered(ledger, base, 50, store.count_since, running=first.run_id) is None
    # unfinished (a restart): the same repeat again
    assert default_descriptor(cfg, ledger=ledger, new_samples=store.count_since).run_id == first.run_id
    ledger.set(first.run_id, "finished", 2, extra={"snapshot_last_id": int(store.snapshot().max())})
    assert default_descriptor(cfg, ledger=ledger, new_samples=store.count_since) is None  # 0 new samples
    drop("c.npz", 49)
    assert default_descriptor(cfg, ledger=ledger, new_samples=store.count_since) is None  # 49 < 50
    drop("d.npz", 1)
    second = default_descriptor(cfg, ledger=ledger, new_samples=store.count_since)
    assert second.run_id == sample_run_id(base, 1) == base + ".s1"
    # after a restart the ledger still knows the last snapshot: no rerun, no early repeat
    ledger.set(second.run_id, "finished", 2, extra={"snapshot_last_id": int(store.snapshot().max())})
    assert default_descriptor(cfg, ledger=RunLedger(tmp_path), new_samples=store.count_since) is None
    assert store.count_since(0) == store.count() == 160
    with pytest.raises(ConfigError, match="algorithm.every_samples"):
        config_from_dict({"algorithm": {"every_samples": 10}})  # needs the sample store
    with pytest.raises(ConfigError, match="algorithm.every_samples"):
        config_from_dict({"algorithm": {"every_samples": 0},
                          "data": {"dataset": "store", "input_shape": [3, 4], "num_classes": 2}})


def test_submit_key_value_pairs_are_parsed_as_json_or_text():
    from dfl_agent.cli.cli_runs import _pairs

    assert _pairs(["round_timeout=20", "rule=median", "on=true", "w=[1, 2]"], "--option") == \
        {"round_timeout": 20, "rule": "median", "on": True, "w": [1, 2]}
    assert _pairs(None, "--training") == {}
    with pytest.raises(ValueError, match="--training 'steps': expected KEY=VALUE"):
        _pairs(["steps"], "--training")


def test_stopped_run_aborts_local_training_in_its_worker_thread():
    """A cancelled run's round in progress stops computing: train_local in a worker thread
    ends at its next mini-batch once the context's abort event is set."""
    import threading
    import time

    import numpy as np
    import torch

    from dfl_agent.learning.training import TrainConfig, TrainingAborted, abortable, train_local
    from dfl_agent.models import build_model, default_spec

    torch.manual_seed(0)
    model = build_model(default_spec([1, 8, 8], 10, "small"))
    x = np.random.default_rng(0).normal(size=(64, 1, 8, 8)).astype(np.float32)
    y = np.arange(64) % 10
    cfg = TrainConfig(steps=20_000, batch_size=8)
    event, seen, steps = threading.Event(), {}, []

    def count(m):  # a zero regulariser that counts the mini-batches trained
        steps.append(1)
        return torch.zeros(())

    def worker() -> None:
        with abortable(event):
            try:
                train_local(model, x, y, cfg, np.random.default_rng(0), regularizer=count)
            except TrainingAborted as exc:
                seen["aborted"] = exc

    t = threading.Thread(target=worker)
    t.start()
    while not steps and t.is_alive():
        time.sleep(0.01)
    event.set()
    t.join(30)
    assert not t.is_alive() and isinstance(seen.get("aborted"), TrainingAborted)
    assert 0 < len(steps) < cfg.steps  # stopped mid-round
    # with the event clear (and outside any abortable block) training runs as before
    with abortable(threading.Event()):
        assert train_local(model, x, y, TrainConfig(steps=2, batch_size=8), np.random.default_rng(0))["samples"] == 16


def test_adam_training_stops_mid_round_when_its_run_is_stopped():
    """train_adam (fedper, local_adam) checks the abort event before every mini-batch too."""
    import threading

    import numpy as np
    import torch

    from dfl_agent.learning.training import TrainingAborted, abortable, train_adam
    from dfl_agent.models import build_model, default_spec

    torch.manual_seed(0)
    model = build_model(default_spec([1, 8, 8], 10, "small"))
    x = np.random.default_rng(0).normal(size=(16, 1, 8, 8)).astype(np.float32)
    y = np.arange(16) % 10
    before = {k: v.clone() for k, v in model.state_dict().items()}
    event = threading.Event()
    event.set()
    with abortable(event), pytest.raises(TrainingAborted):
        train_adam(model, x, y, epochs=1000, batch_size=8, lr=0.01, rng=np.random.default_rng(0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # stopped before a step


def test_nodes_that_declined_a_run_are_not_waited_for():
    import sys

    from dfl_agent.runtime.service.lobby import RunLobby

    lobby = RunLobby(config_from_dict({}), "me", RunVerifier("default", require_signatures=False))
    lobby.statuses = {"a": {"run": {"id": "r-1", "state": "accepted"}}, "b": {"state": "idle", "run": None}}
    assert lobby.may_join("r-1") == sys.maxsize  # nobody declined: statuses may still be arriving
    lobby.statuses["c"] = {"run": {"id": "r-1", "state": "declined", "reason": "profile"}}
    lobby.statuses["d"] = {"run": {"id": "r-0", "state": "finished"},  # moved on; its history says declined
                           "run_history": {"r-1": {"state": "declined"}}}
    assert lobby.declined_by("r-1") == {"c", "d"} and lobby.may_join("r-1") == 2


def test_nodes_where_a_run_ended_after_training_are_known_to_a_late_joiner():
    from dfl_agent.runtime.service.lobby import RunLobby

    lobby = RunLobby(config_from_dict({}), "me", RunVerifier("default", require_signatures=False))
    lobby.statuses = {"a": {"run": {"id": "r-1", "state": "deployed"}},
                      "b": {"run": {"id": "r-2", "state": "training"},  # moved on: its history says finished
                            "run_history": {"r-1": {"state": "finished"}}},
                      "c": {"run": {"id": "r-1", "state": "training"}},
                      "d": {"run": {"id": "r-1", "state": "failed"}}}  # failed to start: not "ended after training"
    assert lobby.finished_by("r-1") == {"a", "b"}
    assert lobby.finished_by("r-2") == set()
    assert lobby.late_for("r-1") == "the run had ended on 2 member(s)"


def test_a_run_its_members_train_past_round_one_is_too_late_to_join():
    # found in the field lab: a device started while run 0 was at round ~150 joined it from
    # round 1; every member then waited each round's whole deadline (30 s) for its updates
    from dfl_agent.runtime.service.lobby import RunLobby

    lobby = RunLobby(config_from_dict({}), "me", RunVerifier("default", require_signatures=False))
    lobby.statuses = {"a": {"run": {"id": "r-1", "state": "training", "round": 1}},
                      "b": {"run": {"id": "r-1", "state": "accepted", "round": 0}}}
    assert lobby.training_round("r-1") == 1 and lobby.late_for("r-1") == ""  # the run is starting: join
    lobby.statuses["c"] = {"run": {"id": "r-1", "state": "training", "round": 150}}
    lobby.statuses["d"] = {"run": {"id": "r-1", "state": "training", "round": True}}  # not a round
    assert lobby.training_round("r-1") == 150
    assert lobby.late_for("r-1") == "the run was at round 150 on its members"


def _node(state, rnd, reason=""):
    return {"state": "idle", "run": {"id": "r1", "state": state, "round": rnd, "reason": reason}}


def test_run_show_says_what_the_members_ledgers_say_also_after_a_late_cancel():
    from dfl_agent.cli.cli_runs import already_finished, run_view
    from dfl_agent.runtime.shared.run_config import CANCEL_LATE

    msg = {"descriptor": {"run_id": "r1", "algorithm": "fedavg", "rounds": 40}, "cancel_record": True}
    # the cancel reached every member after its last round: each refused it, deployed, recorded finished
    statuses = {n: _node("finished", 40, CANCEL_LATE) for n in ("a", "b", "c")}
    v = run_view("r1", msg, statuses)
    assert v["state"] == "finished" and v["cancel_record"] is True
    assert {n: (x["state"], x["round"], x["reason"]) for n, x in v["nodes"].items()} == \
        {n: ("finished", 40, CANCEL_LATE) for n in "abc"}
    assert already_finished(v) == "already finished on every member (a: finished round 40, b: finished round 40, " \
                                  "c: finished round 40)"
    statuses["c"] = _node("cancelled", 38, "cancelled by the operator")  # one member was still training
    v = run_view("r1", msg, statuses)
    assert v["state"] == "cancelled" and already_finished(v).startswith("already ended on every member")
    statuses["c"] = _node("training", 39)  # still running somewhere: a cancel may stop it
    assert already_finished(run_view("r1", {**msg, "cancel_record": False}, statuses)) is None
    assert already_finished(run_view("r1", msg, {})) is None  # no member has it yet


def test_run_submit_reads_each_devices_answer_from_its_status():
    from dfl_agent.cli.cli_runs import run_answers

    before = {n: {"unsigned": 1} for n in "abcdef"}
    statuses = {
        "a": _node("accepted", 0),
        "b": {"state": "training", "run": {"id": "r0", "state": "training", "round": 3}, "runs_queued": ["r0", "r1"]},
        "c": _node("declined", 0, "algorithm cfa not allowed by profile generic-x86"),
        "d": {"state": "idle", "run": None, "runs_refused": {"unsigned": 1, "unknown_key": 1}},
        "e": _node("declined", 0, "not a member of this run"),
        "f": {"state": "idle", "run": None, "runs_refused": {"unsigned": 1}},  # not yet
        "g": {"state": "idle", "run": None, "runs_refused": {"unknown_key": 4}},  # no baseline: unknown
        "h": {"state": "idle", "run_history": {"r1": {"state": "finished", "round": 2}}},
    }
    assert run_answers("r1", statuses, before) == {
        "a": {"answer": "accepted", "reason": ""}, "b": {"answer": "queued", "reason": "behind run r0"},
        "c": {"answer": "declined", "reason": "algorithm cfa not allowed by profile generic-x86"},
        "d": {"answer": "refused", "reason": "unknown_key"}, "e": {"answer": "not a member", "reason": ""},
        "h": {"answer": "accepted", "reason": ""}}
