"""bench/lab/round_spread.py: the share of settled rounds' pairs in which the later round is
more than the tolerance below the earlier."""

from bench.lab.round_spread import settled_pairs


def test_a_pair_counts_when_the_later_round_is_more_than_the_tolerance_below():
    assert settled_pairs([1.0, 0.9, 0.95], 0.02) == (2, 3)  # 1.0 -> 0.9 and 1.0 -> 0.95; 0.9 -> 0.95 rose
    assert settled_pairs([0.90, 0.88, 0.87], 0.02) == (1, 3)  # only 0.90 -> 0.87 is more than 2 points
    assert settled_pairs([0.5], 0.02) == (0, 0)
