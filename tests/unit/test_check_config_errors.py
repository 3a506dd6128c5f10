"""Configuration errors: one line naming the key, exit 2, no state directory left."""

import subprocess
import sys

import pytest

CASES = [
    ("[discovery]\nstatic_peers = [5]\n", "discovery.static_peers[0]"),
    ("[discovery]\nstatic_peers = [{port = 1}]\n", "discovery.static_peers[0]"),
]


#: the sample store's schema: one check (dfl_agent.runtime.shared.sample_store.check_schema) for check-config and run
STORE_CASES = [
    ('[data]\ndataset = "store"\ninput_shape = [3, -1]\nnum_classes = 2\n', "data.input_shape"),
    ('[data]\ndataset = "store"\ninput_shape = [3, 4]\nnum_classes = 3\nclass_names = ["a", "b"]\n',
     "data.class_names"),
]


@pytest.mark.parametrize("extra,key,command", [(*c, "check-config") for c in CASES + STORE_CASES]
                         + [(*c, "run") for c in CASES[:1] + STORE_CASES])
def test_config_error_is_one_line_exit_2_and_leaves_no_state(tmp_path, extra, key, command):
    state = tmp_path / "state"
    path = tmp_path / "node.toml"
    path.write_text(f'federation = "f"\nstate_dir = "{state}"\n{extra}')
    args = [command, "--config", str(path)] + (["--once"] if command == "run" else [])
    p = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", *args],
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in lines[0], lines
    assert not state.exists()


# -- the start-up checks themselves, in process (the subprocess cases are in
# -- tests/system/test_bad_input.py) ----------------------------------------------------

def _cfg(tmp_path, **sections):
    from dfl_agent.runtime.shared.config import config_from_dict

    raw = {"federation": "f", "node_id": "n0", "state_dir": str(tmp_path / "state"),
           "data": {"dataset": "digits"}, "mqtt": {"broker": "127.0.0.1:1"}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return config_from_dict(raw)


@pytest.mark.parametrize("sections,message", [
    ({"algorithm": {"name": "nope"}}, "algorithm.name: unknown algorithm 'nope'"),
    ({"algorithm": {"options": {"bogus": 1}}}, "algorithm.options.bogus: unknown option"),
    ({"algorithm": {"options": {"round_timeout": 0}}}, "algorithm.options.round_timeout: must be > 0"),
    ({"algorithm": {"options": {"round_timeout": -2}}}, "algorithm.options.round_timeout: must be > 0"),
    ({"data": {"dataset": "nope"}}, "data.dataset: unknown dataset 'nope'"),
    ({"data": {"dataset": "npz", "path": "{tmp}/missing"}}, "data.path: {tmp}/missing does not exist"),
    ({"data": {"dataset": "npz", "path": "{tmp}/a_file"}}, "data.path: {tmp}/a_file is a file, not a directory"),
    ({"data": {"dataset": "npz", "path": "{tmp}/random"}}, "data.path: {tmp}/random/train.npz: not an .npz archive"),
    ({"discovery": {"static_peers": ["b", "b"]}}, "discovery.static_peers: "),
])
def test_check_startup_names_the_key_and_writes_nothing(tmp_path, sections, message):
    import numpy as np

    from dfl_agent.runtime.shared.config import ConfigError
    from dfl_agent.runtime.shared.preflight import check_startup

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "train.npz").write_bytes(np.random.default_rng(1).bytes(2048))
    fill = lambda v: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v  # noqa: E731
    sections = {k: {kk: fill(vv) for kk, vv in v.items()} for k, v in sections.items()}
    with pytest.raises(ConfigError) as e:
        check_startup(_cfg(tmp_path, **sections))
    assert str(e.value).startswith(fill(message)), str(e.value)
    assert "\n" not in str(e.value) and "pickle" not in str(e.value)
    assert not (tmp_path / "state").exists()


def test_check_startup_passes_a_good_config_and_writes_nothing(tmp_path):
    from dfl_agent.runtime.shared.preflight import check_startup

    check_startup(_cfg(tmp_path, algorithm={"options": {"round_timeout": 5.0}}))
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("data,message", [
    ({"input_shape": [3, -1], "num_classes": 2}, "data.input_shape: must be a non-empty list of positive sizes"),
    ({"input_shape": [3, 4], "num_classes": 3, "class_names": ["a", "b"]}, "data.class_names: 2 names for "
                                                                            "num_classes=3"),
])
def test_store_schema_one_check_for_check_config_and_run(tmp_path, data, message):
    """check_startup (check-config and run) and open_store (run's start) raise the same
    ConfigError from the one schema check, and nothing is written."""
    import dfl_agent.runtime.shared.sample_store as store_runtime
    from dfl_agent.runtime.shared.config import ConfigError
    from dfl_agent.runtime.shared.preflight import check_startup

    cfg = _cfg(tmp_path, data={"dataset": "store", **data})
    for check in (check_startup, lambda c: check_startup(c, load=False),  # check-config, run
                  lambda c: store_runtime.open_store(c),  # run, as the agent starts
                  lambda c: store_runtime.check_schema(c)):  # the one check the others call
        with pytest.raises(ConfigError) as e:
            check(cfg)
        assert str(e.value).startswith(message), str(e.value)
    assert not (tmp_path / "state").exists()
