"""Every registered algorithm runs with ``dflctl simulate --algorithm X --dataset har`` and its
default model; a forced model the algorithm cannot use is a one-line error naming the fix."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from dfl_agent.algorithms.base import available  # noqa: E402
from dfl_agent.cli.dflctl import main  # noqa: E402
from dfl_agent.runtime.shared.assembly import algorithm_default_spec, check_algorithm_models  # noqa: E402


@pytest.mark.parametrize("algorithm", available())
def test_simulate_har_with_defaults_completes(algorithm, tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--algorithm", algorithm, "--dataset", "har", "--nodes", "3", "--rounds", "1",
               "--steps", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_completed"] == 1 and s["nodes"] == 3
    # the algorithm's default model is one it can use
    check_algorithm_models(algorithm, list(s["model_specs"].values()))


def test_defaults_pick_the_family_the_algorithm_needs():
    assert algorithm_default_spec("fedd2s", (3, 128), 6)["type"] == "convdense"
    assert algorithm_default_spec("fedavg", (3, 128), 6)["type"] == "cnn1d"
    assert algorithm_default_spec("fedd2s", (3, 128), 6, "small")["conv"] == [4, 8, 16]


def test_forcing_an_incompatible_model_is_one_line(capsys):
    rc = main(["simulate", "--algorithm", "fedd2s", "--dataset", "har", "--nodes", "2", "--rounds", "1",
               "--models", '[{"type": "cnn1d", "in_channels": 3, "length": 128, "channels": [8], "num_classes": 6}]'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "convdense" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="width-scaled"):
        check_algorithm_models("heterofl", [algorithm_default_spec("fedd2s", (3, 128), 6),
                                            algorithm_default_spec("fedavg", (3, 128), 6)])
