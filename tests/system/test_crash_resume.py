"""Crash safety of a real agent process, and what ``dflctl peers`` shows meanwhile.

The agent is SIGKILLed at random moments 20 times in a row (during training, during
evaluation, during checkpointing: its rounds are short, so every phase gets hit).
After every kill the checkpoint folder must hold a readable checkpoint at the round
the agent had reached or later, holding the records of the rounds after the last one
written (background evaluation writes a round's record after its checkpoint), and the
restarted agent must resume from exactly that checkpoint with a bit-identical state
(the digest of the restored state equals the digest recorded when the checkpoint was
written).  After every resume, every round up to the checkpoint's has exactly one
metrics record: none lost, none written twice.  Meanwhile ``dflctl peers`` (its
row builder over a live observer, and the command itself) must list the node online
within 5 s of its MQTT connection and offline within the last-will delay after a kill.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.cli.observer import Observer
from dfl_agent.cli.tables import peer_rows
from dfl_agent.runtime.node.checkpoint import CheckpointStore
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]

KILLS = int(os.environ.get("DFL_CRASH_KILLS", "20"))
KEEPALIVE = 2  # s; the broker publishes the last will after 1.5 x keepalive
RESUMED = re.compile(r"resuming at round (\d+) \(restored state digest ([0-9a-f]{64})\)")


def _wait(pred, timeout, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


def _metrics_rounds(path):
    """The round of every record in the metrics file, in file order."""
    if not path.exists():
        return []
    rounds = []
    for line in path.read_text().splitlines():
        try:
            rounds.append(json.loads(line)["round"])
        except (ValueError, KeyError):
            pass  # a record torn by the kill
    return rounds


def _last_metrics_round(path):
    return max(_metrics_rounds(path), default=0)


@needs_mosquitto
def test_sigkill_at_random_moments_never_corrupts_state_and_resumes(tmp_path, capsys):
    rnd = random.Random(1234)
    fed = f"crash{os.getpid()}"
    state = tmp_path / "state"
    with start_broker("mosquitto") as broker:
        cfg = config_from_dict({
            "federation": fed, "node_id": "victim", "state_dir": str(state),
            "algorithm": {"name": "local", "rounds": 100000},
            "training": {"epochs": 1, "batch_size": 64},
            "data": {"dataset": "digits", "partition": "iid"},
            "model": {"size": "small"},
            "mqtt": {"broker": broker.endpoint, "keepalive": KEEPALIVE, "heartbeat_interval": 1.0},
            "discovery": {"mdns": False},
        })
        path = tmp_path / "node.toml"
        path.write_text(dump_toml(cfg))
        store = CheckpointStore(state / "checkpoints")
        obs = Observer(broker.endpoint, fed).start()
        expected = None  # (round, digest) of the newest valid checkpoint after the last kill
        resumed_records = 0  # records written at a resume (lost by a kill otherwise); evidence only
        listed, offline = [], []
        try:
            for k in range(KILLS):
                log_path = tmp_path / f"run{k}.log"
                proc = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                                        stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
                try:
                    # the node connects: dflctl peers must list it online within 5 s
                    connected = _wait(lambda: "connected to" in log_path.read_text() and time.monotonic(), 120)
                    assert connected, log_path.read_text()[-2000:]
                    seen = _wait(lambda: any(r["node_id"] == "victim" and r["state"] == "online" and
                                             r["round"] is not None for r in peer_rows(*obs.snapshot()))
                                 and time.monotonic(), 10)
                    assert seen, peer_rows(*obs.snapshot())
                    listed.append(seen - connected)
                    if expected is not None:
                        m = _wait(lambda: RESUMED.search(log_path.read_text()), 60)
                        assert m, log_path.read_text()[-2000:]
                        resumed_round, digest = int(m.group(1)), m.group(2)
                        assert resumed_round == expected[0] + 1  # resumes right after the checkpoint
                        assert digest == expected[1]  # bit-identical restored state
                        # the records the kill kept from the file are written at resume:
                        # every round up to the checkpoint's has exactly one record, and none
                        # twice (the resumed agent may already have written the records of
                        # rounds after it: its rounds take milliseconds)
                        rounds = _metrics_rounds(state / "metrics.jsonl")
                        assert [r for r in sorted(rounds) if r <= expected[0]] == list(range(1, expected[0] + 1)), \
                            (expected[0], rounds)
                        assert len(rounds) == len(set(rounds)), (expected[0], rounds)
                        resumed_records = len(re.findall(r'"written_at_resume": true',
                                                          (state / "metrics.jsonl").read_text()))
                    if k % 3 == 0:
                        # past the first round (slow: torch's lazy imports), so that the state
                        # moves on; then rounds last ~0.1 s and the kill lands anywhere in
                        # training, evaluation, checkpoint writing or status publishing
                        done = expected[0] + 1 if expected else 2
                        assert _wait(lambda: _last_metrics_round(state / "metrics.jsonl") >= done, 120)
                    # a random moment (other iterations: mostly within the first round after
                    # the restart, i.e. during set-up or training)
                    time.sleep(rnd.uniform(0.0, 1.0))
                finally:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(30)
                killed = time.monotonic()
                reached = _last_metrics_round(state / "metrics.jsonl")
                ck = store.load_latest()  # never unreadable
                if reached == 0:
                    assert ck is None or ck.round <= 1
                else:
                    assert ck is not None, os.listdir(state / "checkpoints")
                    # a round's record is written only after its checkpoint (evaluation runs in
                    # the background): the checkpoint is at the round reached or later, and it
                    # holds the records of the rounds after the last one written
                    assert ck.round >= reached, (reached, ck.round)
                    pending = {r["round"] for r in json.loads(ck.manifest.get("pending_records", "[]"))}
                    assert set(range(reached + 1, ck.round + 1)) <= pending, (reached, ck.round, pending)
                if ck is not None:
                    assert ck.round == store.rounds()[0] or ck.round == store.rounds()[1]
                    expected = (ck.round, ck.manifest["state_digest"])
                if k < 3 or k == KILLS - 1:  # the last will (waiting for it every time costs 3 s)
                    gone = _wait(lambda: any(r["node_id"] == "victim" and r["state"] == "offline (last will)"
                                             for r in peer_rows(*obs.snapshot())) and time.monotonic(), 15)
                    assert gone, peer_rows(*obs.snapshot())
                    offline.append(gone - killed)
        finally:
            obs.stop()
        # the dflctl command itself (fresh observer, retained topics)
        capsys.readouterr()
        assert dflctl(["peers", "--json", "--broker", broker.endpoint, "--federation", fed]) == 0
        rows = json.loads(capsys.readouterr().out)["peers"]
    assert [r["state"] for r in rows if r["node_id"] == "victim"] == ["offline (last will)"]
    assert expected is not None and expected[0] >= 1
    assert max(listed) <= 5.0, listed
    assert max(offline) <= 1.5 * KEEPALIVE + 1.0, offline
    print(f"kills {KILLS}; listed online after connect: max {max(listed):.2f}s; "
          f"offline after kill: max {max(offline):.2f}s; last checkpoint round {expected[0]}; "
          f"records written at resume {resumed_records}")


WRITER = """
import sys, numpy as np
from dfl_agent.runtime.node.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1])
ck = store.load_latest()
t = ck.round if ck else 0
print("start", t, flush=True)
while True:
    t += 1
    w = np.full((1 << 21,), t, dtype=np.float32)  # 8 MB: the kill often lands mid-write
    store.save(t, {"model.w": w}, {"round": t}, info={"node_id": "w"})
"""


def test_sigkill_during_checkpoint_writes_never_leaves_an_unreadable_state(tmp_path):
    """A process that does nothing but write checkpoints, killed 20 times at random
    moments: the newest readable checkpoint is always complete and consistent."""
    rnd = random.Random(99)
    folder = tmp_path / "ck"
    store = CheckpointStore(folder)
    last = 0
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        assert line.startswith("start"), line
        assert int(line.split()[1]) == last  # resumes from the newest checkpoint it could read
        time.sleep(rnd.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        ck = store.load_latest()
        if ck is None:
            assert last == 0
            continue
        assert ck.round >= last and ck.meta == {"round": ck.round}
        assert (ck.tensors["model.w"] == ck.round).all() and ck.tensors["model.w"].shape == (1 << 21,)
        last = ck.round
    assert last >= 1
