"""Every algorithm declares its traits on its class, and the registry, the traits and
the options read without torch (the torch-free supervisor and ``dflctl check-config``
read them)."""

from __future__ import annotations

import subprocess
import sys

_PROBE = r"""
import sys
sys.modules["torch"] = None
import dataclasses
from dfl_agent.algorithms.base import available, get_algorithm, parse_options
names = available()
for name in names:
    cls = get_algorithm(name)
    opts = parse_options(cls, {})
    dataclasses.asdict(opts)
    TRAITS
leaked = sorted(m for m in sys.modules if (m == "torch" or m.startswith("torch.")) and sys.modules[m] is not None)
print("NAMES", len(names), "LEAKED", leaked)
"""


def test_registry_traits_and_options_read_without_torch() -> None:
    body = _PROBE.replace("TRAITS", "assert cls.traits.family and cls.traits.copies(5) > 0")
    r = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LEAKED []" in r.stdout and "NAMES 0 " not in r.stdout, r.stdout


def test_every_algorithm_declares_its_own_traits() -> None:
    from dfl_agent.algorithms.base import FAMILIES, Traits, available, get_algorithm

    for name in available():
        cls = get_algorithm(name)
        assert isinstance(cls.__dict__.get("traits"), Traits), name
        assert cls.traits.family in FAMILIES, name
        assert set(cls.traits.required_roles) <= {"trainer", "sender", "receiver"}, name


def test_register_refuses_a_class_without_traits() -> None:
    import pytest

    from dfl_agent.algorithms.base import Algorithm, register

    class NoTraits(Algorithm):
        name = "no-traits-test"

    with pytest.raises(ValueError, match="declares no traits"):
        register(NoTraits)
    with pytest.raises(ValueError, match="family"):
        from dfl_agent.algorithms.base import Traits

        Traits("star")


def test_traits_drive_the_profile_rule() -> None:
    from dfl_agent.algorithms.base import available, traits_of
    from dfl_agent.profiles.behaviour import models_held, peer_incompatibility, profile_compression_policy

    for name in available():
        t = traits_of(name)
        assert models_held(name, 5) == t.copies(5)
        assert not (t.mixes_architectures and t.same_architecture), name
        # a peer with another model hash is excluded exactly where members share one architecture
        peer = type("Peer", (), {"algorithm": name, "model_hash": "b"})()
        assert (peer_incompatibility(name, "a")(peer) is not None) == t.same_architecture, name
        if t.choco_gossip:
            assert profile_compression_policy(object(), name) is None  # type: ignore[arg-type]
    # the rotating aggregators that hold every participant's model hold the most copies
    assert models_held("dfml", 5) == 30.0 and models_held("local", 5) == 3.0 and models_held("local_adam") == 4.0


def test_each_family_is_its_protocol_and_each_algorithm_its_own_module() -> None:
    from dfl_agent.algorithms.base import available, get_algorithm
    from dfl_agent.algorithms.protocols.lockstep import LockStepAlgorithm
    from dfl_agent.algorithms.protocols.neighbourhood import NeighbourhoodAlgorithm
    from dfl_agent.algorithms.protocols.pairs import PairAlgorithm
    from dfl_agent.algorithms.protocols.rotating import RotatingAggregator

    bases = {"rotating": RotatingAggregator, "neighbourhood": NeighbourhoodAlgorithm, "pairs": PairAlgorithm,
             "lockstep": LockStepAlgorithm}
    modules = set()
    for name in available():
        cls = get_algorithm(name)
        base = bases.get(cls.traits.family)
        if base is None:  # local: no protocol
            assert not any(issubclass(cls, b) for b in bases.values()), name
        else:
            assert issubclass(cls, base), name
        assert cls.__module__ == "dfl_agent.algorithms." + name.replace("-", "_"), name
        modules.add(cls.__module__)
    assert len(modules) == len(available())


def test_options_that_replace_a_training_setting_say_so_and_old_names_still_work(caplog) -> None:
    import dataclasses

    import pytest

    from dfl_agent.algorithms.base import get_algorithm, parse_options

    for name in ("fedd2s", "fedper", "local_adam"):
        fields = {f.name for f in dataclasses.fields(get_algorithm(name).Options)}
        assert "adam_lr" in fields and "lr" not in fields and "batch_size" not in fields, name
    with caplog.at_level("WARNING"):
        opts = parse_options(get_algorithm("fedper"), {"lr": 0.02, "local_epochs": 2, "batch_size": 16})
    assert (opts.adam_lr, opts.adam_epochs, opts.adam_batch_size) == (0.02, 2, 16)
    assert "algorithm.options.lr is deprecated: it is now called algorithm.options.adam_lr" in caplog.text
    assert parse_options(get_algorithm("fedd2s"), {"batch_size": 8}).distill_batch_size == 8
    with pytest.raises(ValueError, match="give only 'adam_lr'"):
        parse_options(get_algorithm("local_adam"), {"lr": 0.02, "adam_lr": 0.03})
