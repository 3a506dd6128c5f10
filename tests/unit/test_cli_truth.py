"""dflctl's small truths: a mistyped command or option gets "did you mean", an error shows the
usage of the command it concerns, ``--help`` is plain text, ``data status`` names classes,
and an ONNX export leaves no torch FutureWarning in the log."""

import argparse
import warnings

import numpy as np
import pytest

from dfl_agent.cli.dflctl import build_parser
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.store.sqlite import SampleStore, Schema
from tests.unit.test_store import SCHEMA, drop, good, npz_bytes


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        dflctl(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_mistyped_command_says_did_you_mean(capsys):
    assert "invalid choice: 'runs' (did you mean 'run'?)" in _error(capsys, ["runs"])
    assert "(did you mean 'status'?)" in _error(capsys, ["data", "statu"])
    assert "did you mean" not in _error(capsys, ["zzzzzz"])


def test_unknown_option_prints_the_commands_usage(capsys):
    err = _error(capsys, ["peers", "--brokr", "x"])
    assert err.startswith("usage: dflctl peers "), err
    assert "dflctl peers: error: unrecognized arguments: --brokr x" in err and "--brokr -> --broker" in err
    err = _error(capsys, ["run", "list", "--bogus"])
    assert err.startswith("usage: dflctl run list"), err


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in set(action.choices.values()):
                yield from _parsers(sp)


def test_help_texts_carry_no_rest_markup():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 20
    for p in parsers:
        text = p.format_help()
        assert "``" not in text and ":func:`" not in text, (p.prog, text)


def test_data_status_prints_class_names(tmp_path, capsys):
    named = SampleStore(tmp_path / "named", SCHEMA)  # class_names a, b, c, d
    drop(named.spool_dir, "x.npz", npz_bytes(**good(12)))
    named.ingest_spool()
    named.close()
    unnamed = SampleStore(tmp_path / "unnamed", Schema((3, 8), 4))
    drop(unnamed.spool_dir, "x.npz", npz_bytes(**good(12)))
    unnamed.ingest_spool()
    unnamed.close()
    capsys.readouterr()
    assert dflctl(["data", "status", "--state-dir", str(tmp_path / "named")]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("  class 0 (a): ") for line in out.splitlines()), out
    assert dflctl(["data", "status", "--state-dir", str(tmp_path / "unnamed")]) == 0
    out = capsys.readouterr().out
    assert "(0)" not in out and any(line.startswith("  class 0: ") for line in out.splitlines()), out
    assert "set data.class_names" in out


def test_onnx_export_leaves_no_future_warning():
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    from dfl_agent.models.onnx_export import export_checked

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(24, 4))
    x = np.random.default_rng(0).normal(size=(8, 3, 8)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = export_checked(model, (3, 8), x, atol=1e-5)  # onnxruntime agrees with torch
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future
    assert data[:2] and len(data) > 100
