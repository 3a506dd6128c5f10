"""The one majority rule (:func:`~dfl_agent.algorithms.protocols.synchronization.evidence_quorum`),
its edge cases tested once: catch-up evidence and a run finished by its members' say use it."""

from __future__ import annotations

import pytest

from dfl_agent.algorithms.protocols.synchronization import evidence_quorum, majority, quorum_shown
from dfl_agent.runtime.run.rejoin import finished_by_members


@pytest.mark.parametrize("members,lone,need", [
    (0, True, 0), (0, False, 0),  # no member: nothing is enough
    (1, True, 1), (1, False, 2),  # one member: its word counts for catch-up only
    (2, True, 2), (2, False, 2),  # two or more: at least two distinct members...
    (3, True, 2), (4, True, 3), (5, True, 3), (6, False, 4), (7, False, 4),  # ... and more than half
])
def test_the_quorum_of_n_members(members, lone, need):
    assert evidence_quorum(members, lone=lone) == need
    if need:
        assert majority(need, members, lone=lone) and not majority(need - 1, members, lone=lone)
    else:
        assert not majority(0, members, lone=lone) and not majority(5, members, lone=lone)


def test_catch_up_and_finish_decide_by_the_same_rule():
    # catch-up: the need-th highest round shown; one insider's round + 1000 is not enough among three
    assert quorum_shown({"a": 7, "b": 5, "c": 1000}, 3) == 7 and quorum_shown({"c": 1000}, 3) is None
    assert quorum_shown({"a": 9}, 1) == 9  # a single neighbour: followed (by at most the catch-up cap)
    done = {"state": "finished"}
    assert not finished_by_members({"a": done}, {"a"})  # a single member never ends this node's run
    assert finished_by_members({"a": done, "b": done}, {"a", "b", "c"})
    assert not finished_by_members({"a": done, "x": done, "y": done}, {"a", "b", "c"})  # non-members count nothing
