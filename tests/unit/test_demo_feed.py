"""``dflctl demo --feed`` pieces that need no agent: the feeder and the option check."""

from __future__ import annotations

import time

import numpy as np

from dfl_agent.cli.demo_feed import Feeder


def test_feeder_writes_whole_files_up_to_its_limit(tmp_path):
    x = np.arange(50 * 6, dtype=np.float32).reshape(50, 2, 3)
    y = np.arange(50) % 3
    spools = {"a": tmp_path / "a", "b": tmp_path / "b"}
    f = Feeder(spools, {"a": (x, y), "b": (x[:20], y[:20])}, {"a": 10, "b": 10}, chunk=8, interval=0.05,
               log_path=tmp_path / "feed.jsonl")
    f.limit = {"a": 30, "b": 30}  # b has only 20 windows
    f.start()
    deadline = time.monotonic() + 20
    while f.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f.pending() == 0 and f.pos == {"a": 30, "b": 20} and f.remaining() == 20
    time.sleep(0.3)  # at its limit it writes nothing more
    assert f.pos == {"a": 30, "b": 20}
    f.limit["a"] = 50
    deadline = time.monotonic() + 20
    while f.remaining() and time.monotonic() < deadline:
        time.sleep(0.05)
    f.stop()
    f.join(10)
    assert not f.is_alive()
    for nid, want in (("a", x[10:50]), ("b", x[10:20])):
        files = sorted(spools[nid].iterdir())
        assert all(p.suffix == ".npz" and not p.name.startswith(".") for p in files)  # no temporary left
        got = np.concatenate([np.load(p)["x"] for p in files])
        np.testing.assert_array_equal(got, want)  # every window once, in order
    assert len((tmp_path / "feed.jsonl").read_text().splitlines()) == len(f.events) == 6 + 2  # a: 18, 26, 30 | 38, 46, 50; b: 18, 20


def test_feed_rejects_options_of_the_other_demo(capsys):
    from dfl_agent.cli.dflctl import main

    assert main(["demo", "--feed", "--kill", "0@1"]) == 2
    assert "--feed does not take --kill" in capsys.readouterr().err
