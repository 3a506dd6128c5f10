"""Garbage, truncated, oversized and wrong-federation payloads published to a running
agent's inbox are rejected and counted; the agent keeps running and finishes."""

import subprocess
import sys
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from dfl_agent.algorithms.context import Message
from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml
from dfl_agent.transport import wire
from tests.system.conftest import needs_mosquitto

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@needs_mosquitto
def test_bad_payloads_are_counted_and_the_agent_keeps_running(tmp_path):
    fed = "badinput"
    with start_broker("mosquitto") as broker:
        procs = []
        for i in range(2):
            cfg = config_from_dict({
                "federation": fed, "node_id": f"a{i}", "state_dir": str(tmp_path / f"a{i}"),
                "algorithm": {"rounds": 6, "options": {"round_timeout": 10.0}},
                "data": {"num_nodes": 2, "node_index": i},
                "mqtt": {"broker": broker.endpoint, "max_frame_bytes": 1 << 20, "chunk_size": 64 * 1024},
                "discovery": {"min_peers": 1, "start_timeout": 60.0},
            })
            path = tmp_path / f"a{i}.toml"
            path.write_text(dump_toml(cfg))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                stdout=open(tmp_path / f"a{i}.log", "w"), stderr=subprocess.STDOUT))
        obs = Observer(broker.endpoint, fed).start()
        deadline = time.monotonic() + 90
        while obs.snapshot()[0].get("a0", {}).get("state") not in ("running",) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert obs.snapshot()[0]["a0"]["state"] == "running"

        good = Message("model", 1, {"w": np.ones(4, np.float32)}, meta={"samples": 1})
        valid = wire.encode(good, federation=fed, sender="intruder")
        payloads = {
            "garbage": b"\x00garbage\xff" * 10,
            "truncated": valid[: len(valid) // 2],
            "oversized": b"DFL\x01" + b"\x00" * (2 << 20),
            "wrong_federation": wire.encode(Message("model", 1, {"w": np.ones(4, np.float32)}), federation="other",
                                            sender="intruder"),
            "non_finite": wire.encode(Message("model", 1, {"w": np.full(4, np.nan, np.float32)}), federation=fed,
                                      sender="intruder"),
            "wrong_shape": valid,  # decodes, but does not fit the model
        }
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
        pub.connect(broker.host, broker.port)
        pub.loop_start()
        for payload in payloads.values():
            pub.publish(f"dfl/{fed}/node/a0/inbox", payload, qos=1).wait_for_publish(5)
        pub.loop_stop()
        pub.disconnect()

        for p in procs:
            assert p.wait(timeout=180) == 0, (tmp_path / "a0.log").read_text()[-3000:]
        obs.settle()
        status = obs.snapshot()[0]["a0"]
        obs.stop()
    assert status["state"] == "finished" and status["round"] == 6
    errors = status["errors"]
    assert errors.get("malformed", 0) >= 2  # garbage + truncated
    assert errors.get("oversized", 0) >= 1
    assert errors.get("wrong_federation", 0) == 1
    assert errors.get("non_finite", 0) == 1
    # the wrong-shape model comes from an unknown sender: rejected as such (or, from a peer, as incompatible)
    assert errors.get("incompatible", 0) + errors.get("not_neighbour", 0) + errors.get("stale", 0) >= 1
    log = (tmp_path / "a0.log").read_text()
    assert "Traceback" not in log


# -- bad input at start: every check of `run` also in `check-config`; one line, exit 2 ----

BAD_START = {  # case -> (TOML lines added to a valid digits config, the key the error names)
    "unknown_algorithm": ('[algorithm]\nname = "nope"\n', "algorithm.name"),
    "unknown_option": ("[algorithm.options]\nbogus = 1\n", "algorithm.options.bogus"),
    "round_timeout_zero": ("[algorithm.options]\nround_timeout = 0\n", "algorithm.options.round_timeout"),
    "round_timeout_negative": ("[algorithm.options]\nround_timeout = -1.5\n", "algorithm.options.round_timeout"),
    "unknown_dataset": ('[data]\ndataset = "nope"\n', "data.dataset"),
    "static_peer_not_a_string": ("[discovery]\nstatic_peers = [5]\n", "discovery.static_peers[0]"),
    "static_peer_bad_id": ('[discovery]\nstatic_peers = ["not a peer!"]\n', "discovery.static_peers[0]"),
    "data_path_missing": ('[data]\ndataset = "npz"\npath = "{tmp}/missing"\n', "data.path"),
    "data_path_is_a_file": ('[data]\ndataset = "npz"\npath = "{tmp}/a_file"\n', "data.path"),
    "train_npz_random_bytes": ('[data]\ndataset = "npz"\npath = "{tmp}/random"\n', "data.path"),
}


@pytest.mark.parametrize("command", ["check-config", "run"])
@pytest.mark.parametrize("case", sorted(BAD_START))
def test_bad_start_input_is_one_line_exit_2_and_no_state_dir(tmp_path, case, command):
    """Each bad input fails ``check-config`` as it fails ``run --once``: before the network,
    exit code 2, one line on stderr naming the key (no traceback, no numpy advice about
    pickles), and no state directory left behind."""
    (tmp_path / "a_file").write_text("not a directory\n")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "train.npz").write_bytes(np.random.default_rng(0).bytes(4096))
    extra, key = BAD_START[case]
    state = tmp_path / "state"
    path = tmp_path / "node.toml"
    path.write_text(f'federation = "f"\nnode_id = "n0"\nstate_dir = "{state}"\n'
                    '[mqtt]\nbroker = "127.0.0.1:1"\n' + extra.format(tmp=tmp_path)
                    + ("" if "[data]" in extra else '[data]\ndataset = "digits"\n'))
    args = [command, "--config", str(path)] + (["--once"] if command == "run" else [])
    p = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", *args],
                       capture_output=True, text=True, timeout=180)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1, lines
    assert f"{key}:" in lines[0] and "Traceback" not in lines[0], lines
    assert "pickle" not in lines[0].lower(), lines
    if case == "data_path_is_a_file":
        assert "is a file, not a directory" in lines[0], lines
    assert not state.exists(), sorted(str(x) for x in state.rglob("*"))
