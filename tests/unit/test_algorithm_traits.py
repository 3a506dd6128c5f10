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
    body = _PROBE.replace("TRAITS", "pass")
    r = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "NAMES 18 LEAKED []" in r.stdout, r.stdout
