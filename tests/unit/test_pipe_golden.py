"""The typed pipe writes and reads what it did at the commit ``golden.json`` names: the same
JSON line for every message, and for every line (odd, old or wrong ones too) the same message
or the same error.  ``tests/fixtures/pipe/make_golden.py`` wrote the fixture."""

import json
from pathlib import Path

import pytest

from dfl_agent.runtime.shared import pipe
from dfl_agent.runtime.shared.pipe import *  # noqa: F403 - the fixture's expressions name the messages

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "pipe" / "golden.json").read_text())


@pytest.mark.parametrize("expr,line", GOLDEN["written"], ids=[w[0][:40] for w in GOLDEN["written"]])
def test_a_message_is_written_as_before(expr, line):
    msg = eval(expr)
    assert pipe.to_line(msg).decode() == line
    assert pipe.from_line(line) == msg


@pytest.mark.parametrize("line,kind,result", GOLDEN["read"], ids=[r[0][:40] for r in GOLDEN["read"]])
def test_a_line_is_read_as_before(line, kind, result):
    raw = line.encode("latin-1")
    if kind == "ok":
        assert repr(pipe.from_line(raw)) == result
    else:
        with pytest.raises(pipe.PipeError) as exc:
            pipe.from_line(raw)
        assert str(exc.value) == result
