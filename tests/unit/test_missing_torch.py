"""Without PyTorch (the base wheel without the ``train`` extra), the commands that train say
so in one line naming the extra, with exit code 2, instead of a traceback or a table of nan."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dfl_agent.extras import missing_torch


def test_missing_torch_names_the_train_extra() -> None:
    assert "[train]" in (missing_torch(ModuleNotFoundError("No module named 'torch'", name="torch")) or "")
    assert missing_torch(ModuleNotFoundError("No module named 'zstd'", name="zstd")) is None
    assert missing_torch(ValueError("torch")) is None


NO_TORCH = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
    import importlib.util
    importlib.util.find_spec = (lambda f: (lambda name, *a: None if name == "torch" else f(name, *a)))(
        importlib.util.find_spec)
""")


@pytest.mark.parametrize("argv", [["dfl_agent.runtime.service.daemon", "run", "--once", "--config", "CFG"],
                                  ["dfl_agent.cli.dflctl", "demo", "--nodes", "2"]])
def test_commands_that_train_say_torch_is_missing(tmp_path, argv) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'federation = "x"\nstate_dir = "{tmp_path / "state"}"\n[algorithm]\nname = "local"\nrounds = 1\n'
                   '[data]\ndataset = "digits"\n[discovery]\nmdns = false\n')
    args = [a.replace("CFG", str(cfg)) for a in argv]
    code = NO_TORCH + f"import runpy; sys.argv = {[args[0], *args[1:]]!r}; runpy.run_module({args[0]!r}, run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "training needs PyTorch, which is not installed" in r.stderr and "[train]" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
