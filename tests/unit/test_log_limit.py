"""jsonbound.LogLimit and RateLimitedLog: a recurring error or drop is logged a few times, then
once a minute with how many were held back; keys are bounded."""

import logging

from dfl_agent.jsonbound import LogLimit, RateLimitedLog


def test_the_burst_then_one_line_a_minute_with_the_count_held_back():
    now = [0.0]
    limit = LogLimit(every=60.0, burst=2, clock=lambda: now[0])
    assert [limit.check("k")[0] for _ in range(5)] == [True, True, False, False, False]
    now[0] += 61.0
    assert limit.check("k") == (True, 3, False)  # three held back since the last line
    assert limit.check("other") == (True, 0, True)  # another key: its own burst


def test_keys_stay_bounded():
    limit = LogLimit(burst=1, max_keys=10)
    for i in range(100):
        assert limit.check(i)[0]  # forgotten past max_keys: never more than 11 kept
    assert len(limit._keys) <= 11


def test_rate_limited_log_gives_tracebacks_for_the_burst_then_a_count(caplog):
    now = [0.0]
    errors = RateLimitedLog(logging.getLogger("t"), every=60.0, burst=2)
    errors.limit.clock = lambda: now[0]
    with caplog.at_level(logging.ERROR, logger="t"):
        for _ in range(10):
            try:
                raise ValueError("bad")
            except ValueError:
                errors.exception("handler failed")
        now[0] += 61.0
        try:
            raise ValueError("bad")
        except ValueError:
            errors.exception("handler failed")
    assert [r.exc_info is not None for r in caplog.records] == [True, True, False]
    assert caplog.records[2].getMessage() == "handler failed: ValueError('bad') (8 more not logged)"
