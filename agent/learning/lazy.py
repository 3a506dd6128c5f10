"""torch, imported on first use.

The algorithm registry, the algorithms' traits and their ``Options`` are read by
torch-free programs (the supervisor, ``dflctl check-config``, the profile rule), so
no module of ``dfl_agent.learning`` or ``dfl_agent.algorithms`` imports torch when it is
itself imported.  They write::

    if TYPE_CHECKING:
        import torch
        from torch import nn
    else:
        from dfl_agent.learning.lazy import nn, torch

and use ``torch``/``nn``/``F`` as usual inside the functions that train: the first
attribute read imports the real module (``ImportError`` then, where torch is missing),
and every later read is a plain attribute lookup.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast


class LazyModule(types.ModuleType):
    """Stands for the module ``name`` and imports it on the first attribute read.

    Raises (on that read):
        ImportError: the module cannot be imported (torch not installed, or blocked).
    """

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        # copy the namespace once: later reads no longer come through __getattr__
        self.__dict__.update({k: v for k, v in vars(module).items() if k not in ("__name__", "__spec__")})
        return getattr(module, attr)


torch: Any = LazyModule("torch")
nn: Any = LazyModule("torch.nn")
F: Any = LazyModule("torch.nn.functional")


_F = TypeVar("_F", bound=Callable[..., Any])


def no_grad(fn: _F) -> _F:
    """``@torch.no_grad()`` for a plain function, without importing torch at decoration."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return cast(_F, wrapper)
