"""What a device sends under differential privacy (dfl_agent.privacy.policy): the policy
table covers every registered algorithm, uncovered combinations are refused with one line,
and the status and announcement leave out the values DP does not protect."""

from __future__ import annotations

import pytest

from dfl_agent.privacy.policy import DP_SUPPORT, TREATMENTS, check_dp_combination, dp_enabled, redact_status


def test_every_registered_algorithm_is_in_the_table():
    from dfl_agent.algorithms.base import available

    assert set(available()) == set(DP_SUPPORT), "add the algorithm to dfl_agent.privacy.policy.DP_SUPPORT"
    for support in DP_SUPPORT.values():
        assert all(t in TREATMENTS for t, _ in support.messages.values())


@pytest.mark.parametrize("algorithm", ["fedavg", "dfml", "gt", "local-steps", "dechetero", "cfa", "dfedavg",
                                       "fedper", "heterofl", "fedrolex", "dfedprox", "fullavg", "combo", "local",
                                       "local_adam"])
def test_covered_algorithms_pass(algorithm):
    check_dp_combination(algorithm, {})


@pytest.mark.parametrize(("algorithm", "options", "words"), [
    ("dechw", {}, "Hessian diagonals"),
    ("dechw", {"theta": 3}, "theta = 0"),
    ("defkt", {}, "transfer"),
    ("fedd2s", {}, "distillation"),
    ("my-new-algorithm", {}, "not in the privacy policy"),
])
def test_uncovered_combinations_are_refused_in_one_line(algorithm, options, words):
    with pytest.raises(ValueError) as err:
        check_dp_combination(algorithm, options)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"privacy.dp: algorithm {algorithm!r} cannot run under differential")
    assert words in msg


def test_dechw_without_hessians_is_covered_also_with_parsed_options():
    from dfl_agent.algorithms.base import get_algorithm, parse_options

    check_dp_combination("dechw", {"theta": 0})
    check_dp_combination("dechw", parse_options(get_algorithm("dechw"), {"theta": 0}))
    with pytest.raises(ValueError, match="Hessian"):
        check_dp_combination("dechw", parse_options(get_algorithm("dechw"), {}))


def test_redact_status_drops_accuracies_and_sample_counts_at_every_level():
    st = {"node_id": "a", "round": 3, "global_accuracy": 0.8, "local_accuracy": 0.9, "regular_global_accuracy": 0.7,
          "local_only_global_accuracy": 0.5, "global_accuracy_source": "local validation",
          "run": {"id": "r1", "state": "training", "accuracy": 0.9, "train_samples": 300},
          "run_history": {"r0": {"state": "recorded", "validation_samples": 66}}, "bytes_sent": 10}
    out = redact_status(st)
    assert out == {"node_id": "a", "round": 3, "global_accuracy_source": "local validation",
                   "run": {"id": "r1", "state": "training"}, "run_history": {"r0": {"state": "recorded"}},
                   "bytes_sent": 10}
    assert st["global_accuracy"] == 0.8  # unchanged


def test_dp_enabled_reads_privacy_dp():
    import types

    assert not dp_enabled(types.SimpleNamespace())
    assert not dp_enabled(types.SimpleNamespace(privacy=types.SimpleNamespace(dp=None)))
    assert dp_enabled(types.SimpleNamespace(privacy=types.SimpleNamespace(dp=object())))
