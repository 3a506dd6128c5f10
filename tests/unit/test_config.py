"""Configuration: defaults, TOML round trip, and errors that name the offending key."""

import subprocess
import sys

import pytest

from dfl_agent.runtime.shared.config import ConfigError, NodeConfig, config_from_dict, dump_toml, load_config


def test_defaults_are_valid():
    cfg = config_from_dict({})
    assert cfg.algorithm.name == "fedavg" and cfg.discovery.interfaces == ["127.0.0.1"]


def test_dump_and_load_round_trip(tmp_path):
    cfg = config_from_dict({"federation": "f1", "algorithm": {"rounds": 3, "options": {"round_timeout": 5.0}},
                            "discovery": {"static_peers": ["a@127.0.0.1:1883"]}})
    p = tmp_path / "n.toml"
    p.write_text(dump_toml(cfg))
    assert load_config(p) == cfg


def test_dump_writes_valid_toml_for_control_characters_and_odd_keys(tmp_path):
    import tomllib

    odd = 'tab\there "quoted" back\\slash nl\n cr\r bell\x07 del\x7f nul\x00 é'
    cfg = config_from_dict({"mqtt": {"password": odd, "username": "\x1b[31mred"},
                            "compression": {"kinds": {"gt.sync": "q8", "a b": "none"}},
                            "algorithm": {"options": {"note": odd, "nested": {"x.y": [1, 2.5, True]}}}})
    text = dump_toml(cfg)
    parsed = tomllib.loads(text)  # raises on invalid TOML
    assert parsed["mqtt"]["password"] == odd and parsed["mqtt"]["username"] == "\x1b[31mred"
    p = tmp_path / "n.toml"
    p.write_text(text, encoding="utf-8")
    assert load_config(p) == cfg
    assert "neighbours =" not in text and "\nevery =" not in text  # unset keys are left out


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"bogus": 1}, "bogus"),
        ({"mqtt": {"chunk_size": 10}}, "mqtt.chunk_size"),
        ({"mqtt": {"broker": "nohost"}}, "mqtt.broker"),
        ({"mqtt": {"protocol": "4"}}, "mqtt.protocol"),
        ({"training": {"lr": "fast"}}, "training.lr"),
        ({"training": {"epochs": 0}}, "training.epochs"),
        ({"training": {"steps": -1}}, "training.steps"),
        ({"data": {"node_index": 5, "num_nodes": 2}}, "data.node_index"),
        ({"discovery": {"interfaces": []}}, "discovery.interfaces"),
        ({"discovery": {"mdns": "yes"}}, "discovery.mdns"),
        ({"federation": "bad id!"}, "federation"),
        ({"algorithm": {"extra": 1}}, "algorithm.extra"),
        ({"runtime": {"init": "random"}}, "runtime.init"),
    ],
)
def test_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert str(e.value).startswith(key)


def test_toml_syntax_error_and_missing_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("federation = ")
    with pytest.raises(ConfigError, match="TOML syntax"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_daemon_refuses_bad_config_with_exit_code_2(tmp_path):
    p = tmp_path / "n.toml"
    p.write_text("[mqtt]\nchunk_size = 5\n")
    r = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "mqtt.chunk_size" in r.stderr


def test_node_config_is_a_dataclass():
    assert NodeConfig().mqtt.protocol == "5"
