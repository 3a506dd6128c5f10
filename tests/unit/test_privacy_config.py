"""The ``[privacy]`` section: parsing, one-line errors naming the key, the profile/node merge."""

from __future__ import annotations

import pytest

from dfl_agent.privacy.config import (
    DPConfig,
    PrivacyConfig,
    PrivacySection,
    merge_privacy,
    parse_privacy,
)


def test_defaults_and_off() -> None:
    assert parse_privacy(None, "privacy") == PrivacyConfig(None, 10.0)
    assert parse_privacy({}, "privacy") == PrivacyConfig(None, 10.0)
    assert parse_privacy(PrivacySection(), "privacy") == PrivacyConfig(None, 10.0)
    assert parse_privacy({"lifetime_epsilon": 4}, "privacy").lifetime_epsilon == 4.0
    assert parse_privacy({"dp": {"enabled": False, "max_grad_norm": 1.0}}, "privacy").dp is None


def test_dp_on() -> None:
    c = parse_privacy({"dp": {"max_grad_norm": 1, "target_epsilon": 3}, "lifetime_epsilon": 12.5}, "privacy")
    assert c == PrivacyConfig(DPConfig(max_grad_norm=1.0, delta=1e-5, target_epsilon=3.0), 12.5)
    c = parse_privacy({"dp": {"max_grad_norm": 0.5, "noise_multiplier": 1.1, "delta": 1e-6}}, "privacy")
    assert c.dp == DPConfig(max_grad_norm=0.5, delta=1e-6, noise_multiplier=1.1)


@pytest.mark.parametrize("table,message", [
    ({"dp": {"max_grad_norm": -1, "noise_multiplier": 1.0}}, "privacy.dp.max_grad_norm: must be > 0, got -1"),
    ({"dp": {"noise_multiplier": 1.0}}, "privacy.dp.max_grad_norm: required when DP is on"),
    ({"dp": {"max_grad_norm": 1.0}}, "privacy.dp: set exactly one of target_epsilon and noise_multiplier"),
    ({"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "target_epsilon": 2.0}},
     "privacy.dp: set exactly one of target_epsilon and noise_multiplier (both are set)"),
    ({"dp": {"max_grad_norm": 1.0, "noise_multiplier": 0}}, "privacy.dp.noise_multiplier: must be > 0, got 0"),
    ({"dp": {"max_grad_norm": 1.0, "target_epsilon": float("inf")}}, "privacy.dp.target_epsilon: must be > 0"),
    ({"dp": {"max_grad_norm": 1.0, "target_epsilon": 1, "delta": 1.5}}, "privacy.dp.delta: must be in (0, 1)"),
    ({"dp": {"max_grad_norm": True, "target_epsilon": 1}}, "privacy.dp.max_grad_norm: expected a number, got True"),
    ({"dp": {"max_grad_norm": 1, "target_epsilon": 1, "sigma": 1}}, "privacy.dp.sigma: unknown key"),
    ({"dp": {"max_grad_norm": 1, "target_epsilon": 1, "enabled": "yes"}}, "privacy.dp.enabled: expected a boolean"),
    ({"dp": 3}, "privacy.dp: must be a table"),
    ({"lifetime_epsilon": -2}, "privacy.lifetime_epsilon: must be > 0, got -2"),
    ({"budget": 2}, "privacy.budget: unknown key"),
])
def test_errors_name_the_key_in_one_line(table, message) -> None:
    with pytest.raises(ValueError) as e:
        parse_privacy(table, "privacy")
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_node_config_wins_key_by_key() -> None:
    profile = {"dp": {"max_grad_norm": 2.0, "noise_multiplier": 1.0, "delta": 1e-6}, "lifetime_epsilon": 8.0}
    node = {"dp": {"target_epsilon": 3.0}}
    merged = merge_privacy(profile, node)
    assert merged == {"dp": {"max_grad_norm": 2.0, "delta": 1e-6, "target_epsilon": 3.0}, "lifetime_epsilon": 8.0}
    assert parse_privacy(merged, "privacy").dp == DPConfig(max_grad_norm=2.0, delta=1e-6, target_epsilon=3.0)
    assert merge_privacy(profile, {"lifetime_epsilon": 5})["lifetime_epsilon"] == 5
    assert merge_privacy(profile, {"dp": {"max_grad_norm": 0.5}})["dp"]["noise_multiplier"] == 1.0
    assert parse_privacy(merge_privacy(profile, {"dp": {"enabled": False}}), "privacy").dp is None
    assert merge_privacy(None, node) == node and merge_privacy(profile, None) == profile
    # sections (the typed tables) merge the same way: unset keys show the profile's through
    from dfl_agent.tomlcheck import build

    sec = build(PrivacySection, {"dp": {"target_epsilon": 3.0}}, "privacy")
    assert merge_privacy(profile, sec) == merged


# -- the node configuration and the device profile ------------------------------------------------
def test_node_config_validates_privacy_with_the_profile() -> None:
    from dfl_agent.runtime.shared.config import ConfigError, config_from_dict, dump_toml

    cfg = config_from_dict({"privacy": {"lifetime_epsilon": 6, "dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.1}}})
    assert parse_privacy(cfg.privacy, "privacy") == PrivacyConfig(DPConfig(1.0, noise_multiplier=1.1), 6.0)
    import tomllib

    assert config_from_dict(tomllib.loads(dump_toml(cfg))) == cfg  # run.toml carries it to the run process
    with pytest.raises(ConfigError, match=r"^privacy.dp.delta: must be in \(0, 1\)"):
        config_from_dict({"privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "delta": 2}}})
    with pytest.raises(ConfigError, match=r"^privacy.dp.clip: unknown key"):
        config_from_dict({"privacy": {"dp": {"clip": 1.0}}})
    # the profile's DP (here through profile_overrides) with the node's target: merged, then valid
    config_from_dict({"profile_overrides": {"privacy": {"dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}}},
                      "privacy": {"dp": {"target_epsilon": 3.0}}})
    with pytest.raises(ConfigError, match=r"^privacy.dp: set exactly one"):
        config_from_dict({"profile_overrides": {"privacy": {"dp": {"max_grad_norm": 1.0}}}})
    with pytest.raises(ConfigError, match=r"^profile_overrides.privacy.dp.max_grad_norm: must be > 0"):
        config_from_dict({"profile_overrides": {"privacy": {"dp": {"max_grad_norm": -1, "target_epsilon": 1}}}})


def test_reference_lists_the_privacy_keys() -> None:
    from dfl_agent.cli.gen_reference import render_config

    text = render_config()
    for key in ("privacy.lifetime_epsilon", "privacy.dp.max_grad_norm", "privacy.dp.delta",
                "privacy.dp.target_epsilon", "privacy.dp.noise_multiplier"):
        assert f"| `{key}` |" in text
    assert "## `[privacy.dp]`\n\nDP-SGD in local training" in text


def test_bad_privacy_config_exits_2_naming_the_key(tmp_path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "node.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[privacy.dp]\nmax_grad_norm = 0\nnoise_multiplier = 1.0\n')
    r = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "check-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "privacy.dp.max_grad_norm: must be > 0, got 0" in r.stderr and "Traceback" not in r.stderr
