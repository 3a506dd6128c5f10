"""``python -m dfl_agent.cli.chaos --netem``: where it cannot run (no root, no ip or tc, or a
kernel without the netem qdisc) it says why in one line and exits 2 before starting anything."""

from __future__ import annotations

import pytest

from dfl_agent.cli import chaos


def test_netem_without_the_qdisc_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(chaos, "_netem_probe", lambda: False)  # a kernel without sch_netem
    out = tmp_path / "chaos"
    assert chaos.main(["--netem", "delay 200ms loss 10%", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("chaos: --netem needs "), err
    assert not out.exists()  # nothing started
    with pytest.raises(RuntimeError, match="--netem needs"):
        chaos.run_chaos(chaos.ChaosOptions(out=str(out), netem="loss 10%"))
    assert not out.exists()
