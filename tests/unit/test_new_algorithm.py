"""Adding an algorithm touches one new module only: a throwaway algorithm, registered from a
temporary module that declares only its traits, reaches the device profiles (the shipped
``algorithms = ["*"]``), the runtime's default model (``runtime/shared/assembly.py``) and
``dflctl algorithms`` without any other file changed."""

import importlib.util
import sys

import pytest

from dfl_agent.algorithms import base
from dfl_agent.profiles import get_profile, list_profiles
from dfl_agent.resources import resource_dir

MODULE = '''
from dfl_agent.algorithms.base import Algorithm, Traits, register


@register
class Throwaway(Algorithm):
    """A neighbourhood algorithm that trains the layered model: traits only."""

    name = "throwaway"
    traits = Traits("neighbourhood", same_architecture=True, default_model="layered")

    async def round(self, t):
        return {}
'''


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """Import the temporary module; the registry is restored afterwards."""
    base.available()  # the built-in algorithms first
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    path = tmp_path / "throwaway_algorithm.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("throwaway_algorithm", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "throwaway_algorithm", module)
    spec.loader.exec_module(module)
    return "throwaway"


def test_profiles_list_a_new_algorithm_where_the_rule_allows_it(throwaway):
    from dfl_agent.profiles.behaviour import allowed_algorithms

    assert throwaway in base.available()
    for prof in list_profiles():
        allowed = {a for a, why in allowed_algorithms(prof).items() if why is None}
        assert set(prof.behaviour.algorithms) == allowed, prof.name
    assert throwaway in get_profile("generic-x86").behaviour.algorithms
    assert throwaway in get_profile("raspberry-pi-4").behaviour.algorithms
    # a sender-only gateway leaves it out, with the rule's reason
    gateway = get_profile("sensor-gateway")
    assert throwaway not in gateway.behaviour.algorithms
    [line] = [x for x in gateway.behaviour.left_out if x.startswith(f"{throwaway}:")]
    assert "receiver" in line
    # no shipped profile file names it
    for f in resource_dir("device_profiles").glob("*.toml"):
        assert throwaway not in f.read_text(), f.name


def test_assembly_reads_the_new_algorithms_default_model(throwaway):
    from dfl_agent.models.defaults import default_model_spec
    from dfl_agent.runtime.shared.assembly import algorithm_default_spec

    spec = algorithm_default_spec(throwaway, [9, 128], 6)
    assert spec == default_model_spec("layered", [9, 128], 6)
    assert spec != algorithm_default_spec("fedavg", [9, 128], 6)


def test_dflctl_algorithms_lists_the_new_algorithm(throwaway, capsys):
    from dfl_agent.cli.dflctl import main

    assert main(["algorithms"]) == 0
    assert throwaway in capsys.readouterr().out.split()
