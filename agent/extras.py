"""How to install an optional extra: the one wording every "X is not installed" hint uses.

dfl-agent is installed from its wheel (``docs/install.md``) or from a source checkout
(``scripts/setup.sh``); it is on no package index, so a hint names the wheel file or the
checkout's script, never a bare package name for pip to look up.  Only the standard library
is imported here.
"""

from __future__ import annotations

from dfl_agent import __version__

#: the extras ``scripts/setup.sh`` installs without arguments
SETUP_EXTRAS = ("train", "plot", "har", "broker", "digits")
#: the further extras ``scripts/setup.sh --test`` installs
SETUP_TEST_EXTRAS = ("test", "onnx", "metrics", "lint", "privacy")


def extra_hint(extra: str) -> str:
    """The install instruction for one optional extra, to end a "not installed" message.

    Args:
        extra: the extra's name in ``pyproject.toml`` (``onnx``, ``metrics``, ``train``...).

    Returns:
        e.g. ``pip install 'dfl_agent-0.1.0-py3-none-any.whl[onnx]' (the wheel dfl-agent was
        installed from; in a source checkout: scripts/setup.sh --test)``.
    """
    if extra in SETUP_EXTRAS:
        checkout = "scripts/setup.sh"
    elif extra in SETUP_TEST_EXTRAS:
        checkout = "scripts/setup.sh --test"
    else:
        checkout = f".venv/bin/pip install -e '.[{extra}]'"
    return (f"pip install 'dfl_agent-{__version__}-py3-none-any.whl[{extra}]' (the wheel dfl-agent was installed from; "
            f"in a source checkout: {checkout})")


def missing_torch(exc: BaseException) -> str | None:
    """The one-line message for ``exc`` when it is PyTorch that is not installed (the base
    wheel without the ``train`` extra), else None."""
    name = getattr(exc, "name", None) or ""
    if isinstance(exc, ModuleNotFoundError) and (name == "torch" or name.startswith("torch.")):
        return f"training needs PyTorch, which is not installed: {extra_hint('train')}"
    return None


def require_torch() -> None:
    """Raise a :class:`ModuleNotFoundError` naming the ``train`` extra when PyTorch is not
    installed (checked without importing it).

    Raises:
        ModuleNotFoundError: torch cannot be imported; its message is :func:`missing_torch`'s.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        exc = ModuleNotFoundError("No module named 'torch'", name="torch")
        raise ModuleNotFoundError(missing_torch(exc), name="torch")
