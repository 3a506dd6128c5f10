"""DecHW's common-initialisation hint (bench/dechw/README.md, "Common initialisation")."""

from __future__ import annotations

from dfl_agent.algorithms.base import common_init_hint, get_algorithm, parse_options
from dfl_agent.cli.dflctl import _dechw_hint


def _opts(**raw):
    return parse_options(get_algorithm("dechw"), raw)


def test_hint_for_dechw_with_common_init_and_hessian_weights_in_every_round():
    hint = common_init_hint("dechw", _opts(), "common", "dirichlet")
    assert hint is not None and "\n" not in hint
    assert "theta=3" in hint and "docs/algorithms-on-devices.md" in hint
    # size_weighting alone did not stop the divergence the hint warns of
    assert common_init_hint("dechw", _opts(size_weighting=True), "common", "dirichlet") == hint
    assert common_init_hint("dechw", _opts(), "common", "shards") == hint


def test_no_hint_where_it_does_not_apply():
    assert common_init_hint("dechw", _opts(), "independent", "dirichlet") is None  # the paper's setting
    assert common_init_hint("dechw", _opts(theta=3), "common", "dirichlet") is None  # DecHW†: τ after θ
    for partition in ("iid", "by-user", None):  # no label skew by construction: not what was measured
        assert common_init_hint("dechw", _opts(), "common", partition) is None
    assert common_init_hint("dechetero", parse_options(get_algorithm("dechetero"), {}), "common", "dirichlet") is None


def test_dflctl_simulate_prints_the_hint_on_stderr_only_when_it_applies(capsys):
    _dechw_hint("dechw", {}, "common", "dirichlet")
    err = capsys.readouterr().err
    assert err.startswith("hint: dechw") and err.count("\n") == 1
    for algorithm, raw, init in [("dechw", {"theta": 3}, "common"), ("dechw", {}, "independent"),
                                 ("dechetero", {}, "common"), ("dechw", {"no_such_option": 1}, "common")]:
        _dechw_hint(algorithm, raw, init, "dirichlet")
        out = capsys.readouterr()
        assert out.err == "" and out.out == "", (algorithm, raw, init)
    _dechw_hint("dechw", {}, "common", "by-user")  # dflctl simulate's default partition
    assert capsys.readouterr().err == ""
