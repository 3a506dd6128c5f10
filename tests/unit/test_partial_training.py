"""HeteroFL / FedRolex sub-model indices (seed 000 Eq. 8, 9) and aggregation (Eq. 6)."""

import numpy as np
import pytest

from dfl_agent.learning.partial import aggregate_partial, check_sub_model, sub_indices


def test_heterofl_takes_the_leading_slice():
    assert sub_indices("heterofl", 7, 8, 3).tolist() == [0, 1, 2]


def test_fedrolex_rolls_and_wraps():
    assert sub_indices("fedrolex", 0, 8, 3).tolist() == [0, 1, 2]
    assert sub_indices("fedrolex", 2, 8, 3).tolist() == [2, 3, 4]
    assert sub_indices("fedrolex", 7, 8, 3).tolist() == [7, 0, 1]  # Eq. 9, second case
    assert sub_indices("fedrolex", 9, 8, 3).tolist() == [1, 2, 3]  # t~ = t mod J
    assert sub_indices("fedrolex", 5, 4, 4).tolist() == [0, 1, 2, 3]  # full width: identity
    with pytest.raises(ValueError):
        sub_indices("fedrolex", 0, 2, 3)
    with pytest.raises(ValueError):
        sub_indices("dropout", 0, 2, 1)


def test_eq6_averages_each_position_over_the_models_holding_it():
    big = {"w": np.full((4, 2), 4.0, np.float32), "b": np.full(4, 4.0, np.float32)}
    small = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    new_big, new_small = aggregate_partial([big, small], "heterofl", t=0)
    assert new_big["w"][:2].tolist() == [[2.0, 2.0]] * 2  # rows 0-1 held by both: mean
    assert new_big["w"][2:].tolist() == [[4.0, 4.0]] * 2  # rows 2-3 only by the big one
    assert new_small["w"].shape == (2, 2) and (new_small["w"] == 2.0).all()
    # FedRolex at t = 3 puts the small model on rows 3 and 0
    nb, ns = aggregate_partial([big, small], "fedrolex", t=3)
    assert nb["b"].tolist() == [2.0, 4.0, 4.0, 2.0]


def test_input_and_output_dims_of_consecutive_layers_use_the_same_indices():
    rng = np.random.default_rng(0)
    big = {"l1": rng.normal(size=(6, 3)), "l2": rng.normal(size=(5, 6))}
    small = {"l1": big["l1"][[4, 5, 0]], "l2": big["l2"][:, [4, 5, 0]]}  # FedRolex window at t = 4
    nb, ns = aggregate_partial([big, small], "fedrolex", t=4)
    # the small model already equals its slice of the big one: nothing changes
    np.testing.assert_allclose(ns["l1"], small["l1"])
    np.testing.assert_allclose(nb["l2"], big["l2"])


def test_models_of_another_family_are_rejected():
    with pytest.raises(ValueError):
        check_sub_model({"a": np.zeros((2, 2))}, {"b": np.zeros((4, 4))})
    with pytest.raises(ValueError):
        check_sub_model({"a": np.zeros((5, 2))}, {"a": np.zeros((4, 4))})


@pytest.mark.parametrize("algorithm", ["heterofl", "fedrolex"])
def test_h1_federation_in_the_simulator(algorithm):
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(algorithm=algorithm, nodes=5, rounds=3, dataset="digits", partition="iid",
                           model_family="H1", train=TrainConfig(batch_size=64)))
    assert s["rounds_completed"] == 3
    assert all(not d for d in s["dropped"].values())  # every width-scaled model was accepted
