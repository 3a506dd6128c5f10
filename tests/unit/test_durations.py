"""One duration grammar for run schedules (``algorithm.every``) and the store's maximum age."""

from __future__ import annotations

import pytest

from dfl_agent.durations import parse_duration, parse_optional_duration


@pytest.mark.parametrize("text,seconds", [
    ("90s", 90), ("15m", 900), ("6h", 21600), ("2d", 172800), ("1w", 604800), ("1.5h", 5400),
    (" 6H ", 21600), ("30", 30), (45, 45), (2.5, 2.5),
])
def test_both_read_the_same_grammar(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_optional_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "6 weeks", "-5s", "1y", "h", "1e3", True])
def test_both_reject_what_is_not_a_duration(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)
    with pytest.raises(ValueError, match="not a duration"):
        parse_optional_duration(text)


def test_a_run_period_is_positive_and_the_store_age_may_be_off():
    for off in (None, "", "none", "None"):
        assert parse_optional_duration(off) is None
    assert parse_optional_duration("0s") == 0.0
    for bad in ("0s", 0, -3, "none"):
        with pytest.raises(ValueError):
            parse_duration(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        parse_optional_duration(-1)
