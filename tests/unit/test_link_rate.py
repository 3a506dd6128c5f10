"""The link-rate rule (dfl_agent.transport.link_rate) and where the agent applies it."""

import logging

import pytest

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.runtime.shared.assembly import link_settings
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.transport.link_rate import (
    FAST_CHUNK,
    FAST_KEEPALIVE,
    MIN_CHUNK,
    derive,
    parse_rate,
)

SPEC = {"type": "mlp", "input_shape": [100], "hidden": [100], "num_classes": 6}  # 10,706 params: 42,824 bytes


@pytest.mark.parametrize("text, bps", [("500kbit", 500e3), ("0.5mbit", 500e3), ("2Mbit/s", 2e6), ("1gbit", 1e9),
                                       ("9600", 9600.0), (9600, 9600.0), ("128kbps", 128e3), ("", None), (0, None)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "-5kbit", "1tbit", True, "1.2.3mbit"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_no_rate_is_the_fast_defaults():
    t = derive(None)
    assert (t.chunk_size, t.keepalive, t.reassembly_timeout, t.connect_timeout) == (FAST_CHUNK, FAST_KEEPALIVE, 30.0, 10.0)
    assert derive("") == t and derive("", chunk_size=4096).chunk_size == 4096


def test_fast_links_keep_the_defaults():
    # 1 mbit/s and faster: 256 KiB chunks (2.1 s at 1 mbit), keepalive 10 s
    for rate in ("1.1mbit", "100mbit", "1gbit"):
        t = derive(rate)
        assert (t.chunk_size, t.keepalive) == (FAST_CHUNK, FAST_KEEPALIVE), rate


def test_slow_links_get_smaller_chunks_and_a_longer_keepalive():
    t = derive("0.5mbit")
    assert t.chunk_size == 125_000 and t.chunk_seconds == pytest.approx(2.0)
    assert t.keepalive == FAST_KEEPALIVE  # 4 chunk times = 8 s < 10 s
    slow = derive("9600bit")  # the 16 KiB floor takes 13.7 s at 9.6 kbit/s
    assert slow.chunk_size == MIN_CHUNK and slow.chunk_seconds == pytest.approx(MIN_CHUNK * 8 / 9600)
    assert slow.keepalive == 55 and slow.reassembly_timeout == 165 and slow.connect_timeout == 55
    for rate in ("9600", "64kbit", "0.5mbit", "2mbit", "10mbit"):
        t = derive(rate)
        # the client cuts a connection silent for 2 x keepalive, the broker for 1.5 x: six chunk times or more
        assert 1.5 * t.keepalive >= 6 * t.chunk_seconds, rate


def test_explicit_settings_win():
    t = derive("64kbit", chunk_size=200_000, keepalive=7)
    assert (t.chunk_size, t.keepalive) == (200_000, 7)
    # a given chunk size sets the keepalive's floor: 25 s at 64 kbit/s
    assert derive("64kbit", chunk_size=200_000).keepalive == 100


def test_round_and_heartbeat_timeouts_cover_the_model_exchange():
    t = derive("0.5mbit")
    # 1 MB to 3 neighbours at 0.5 mbit/s: 48 s; twice that on top of the default
    assert t.exchange_seconds(1_000_000, 3) == pytest.approx(48.0)
    assert t.round_timeout(30.0, 1_000_000, 3) == pytest.approx(126.0)
    assert t.heartbeat_timeout(30.0, 1_000_000, 3) == pytest.approx(96.0)
    assert t.heartbeat_timeout(300.0, 1_000_000, 3) == 300.0
    fast = derive(None)
    assert fast.round_timeout(30.0, 1_000_000, 3) == 30.0 and fast.heartbeat_timeout(30.0, 10**9, 9) == 30.0


def _cfg(**mqtt):
    return config_from_dict({"node_id": "a", "mqtt": mqtt, "discovery": {"mdns": False, "min_peers": 2},
                             "algorithm": {"name": "fedavg", "options": {}}})


def test_config_key_and_its_errors():
    assert _cfg().mqtt.link_rate == "" and _cfg().mqtt.chunk_size is None and _cfg().mqtt.keepalive is None
    assert _cfg(link_rate="256kbit").mqtt.link_rate == "256kbit"
    with pytest.raises(ConfigError, match=r"^mqtt.link_rate: not a link rate: 'fast'"):
        _cfg(link_rate="fast")
    with pytest.raises(ConfigError, match=r"^mqtt.max_frame_bytes"):
        _cfg(link_rate="10mbit", max_frame_bytes=100_000)  # below the derived 256 KiB chunk
    assert _cfg(link_rate="64kbit", max_frame_bytes=100_000).mqtt.max_frame_bytes == 100_000  # 16 KiB chunks


def test_the_agent_applies_the_rule(caplog):
    fedavg = get_algorithm("fedavg")
    cfg = _cfg(link_rate="64kbit")
    caplog.set_level(logging.INFO, "dfl_agent.daemon")
    timings, options, heartbeat = link_settings(cfg, parse_options(fedavg, {}), SPEC)
    assert (timings.chunk_size, timings.keepalive) == (MIN_CHUNK, 10)
    exchange = 42_824 * 2 * 8 / 64_000  # the float32 model to min_peers = 2 neighbours: 10.7 s
    assert options.round_timeout == pytest.approx(30.0 + 2 * exchange)
    assert options.sync_timeout == 2.0  # the update market's short wait is no model exchange
    assert heartbeat == 30.0  # two exchanges (21 s) are shorter than the configured 30 s
    assert "link rate 64000 bit/s: chunks of 16384 bytes" in caplog.text
    # an explicit round_timeout wins; no link rate: nothing changes
    cfg.algorithm.options = {"round_timeout": 12.0}
    assert link_settings(cfg, parse_options(fedavg, {"round_timeout": 12.0}), SPEC)[1].round_timeout == 12.0
    timings, options, heartbeat = link_settings(_cfg(), parse_options(fedavg, {}), SPEC)
    assert (timings.chunk_size, timings.keepalive, options.round_timeout, heartbeat) == (FAST_CHUNK, 10, 30.0, 30.0)


@pytest.mark.parametrize("algorithm, keys", [
    ("defkt", {"receive_timeout": 60.0, "round_timeout": 120.0}),
    ("dfedavg", {"invite_timeout": 60.0, "update_timeout": 300.0, "token_timeout": 120.0}),
    ("gt", {"sync_timeout": 30.0}),
])
def test_every_wait_for_models_is_widened(algorithm, keys):
    cfg = config_from_dict({"node_id": "a", "mqtt": {"link_rate": "64kbit"}, "discovery": {"mdns": False},
                            "algorithm": {"name": algorithm, "options": {}}})
    widened = link_settings(cfg, parse_options(get_algorithm(algorithm), {}), SPEC)[1]
    exchange = 42_824 * 8 / 64_000  # one neighbour (min_peers 0)
    for key, default in keys.items():
        assert getattr(widened, key) == pytest.approx(default + 2 * exchange), key
