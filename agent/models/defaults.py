"""The default model of each algorithm, and the check that a chosen model suits it.

Most algorithms train any model (:func:`dfl_agent.models.default_spec` for the data
set's input shape and the size tier).  Some need a model family:

- ``fedd2s`` distils layer by layer: it needs the layered ``convdense`` model
  (:mod:`dfl_agent.models.convdense`); its default is the seed's M1 widths
  ``conv [8, 16, 32], dense [32, 16]`` scaled by the size tier (×½ small, ×2 large).
- ``heterofl`` and ``fedrolex`` (partial training) aggregate width-scaled members of one
  family: in the simulator their default is DFML's H1 family
  (:mod:`dfl_agent.models.families`, widths 1, ½, ¼, ⅛, 1/16 spread over the nodes); on a
  device the default model of the profile's tier (one family scaled in width).

:func:`check_algorithm_models` turns an unsuitable forced model into one line that
names the fix (``ValueError``), instead of a traceback deep in training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dfl_agent.models import default_spec, validate_spec

#: Algorithms that need a layered ``convdense`` model.
LAYERED = frozenset({"fedd2s"})
#: Algorithms that aggregate width-scaled members of one model family.
WIDTH_SCALED = frozenset({"heterofl", "fedrolex"})
_SCALE = {"small": 0.5, "medium": 1.0, "large": 2.0}


def algorithm_default_spec(algorithm: str, input_shape: Sequence[int], num_classes: int,
                           size: str = "medium") -> dict[str, Any]:
    """The default model spec of ``algorithm`` for inputs of ``input_shape`` (one node).

    Raises:
        ValueError: unknown size tier.
    """
    if size not in _SCALE:
        raise ValueError(f"model size must be one of {sorted(_SCALE)}, got {size!r}")
    shape = list(input_shape)
    if algorithm in LAYERED and len(shape) in (2, 3):
        f = _SCALE[size]
        return validate_spec({"type": "convdense", "input_shape": shape,
                              "conv": [max(4, int(w * f)) for w in (8, 16, 32)],
                              "dense": [max(4, int(w * f)) for w in (32, 16)], "num_classes": num_classes})
    return default_spec(shape, num_classes, size)


def simulator_default_specs(algorithm: str, input_shape: Sequence[int], num_classes: int, nodes: int,
                            size: str = "medium") -> list[dict[str, Any]]:
    """One spec per node for a simulation that chooses no model: H1 spread over the nodes
    for :data:`WIDTH_SCALED` algorithms (on inputs H1 supports), else the algorithm's
    default for every node."""
    if algorithm in WIDTH_SCALED:
        from dfl_agent.models.families import family_specs

        try:
            fam = family_specs("H1", input_shape, num_classes)
        except ValueError:
            fam = []
        if fam:
            return [fam[i % len(fam)] for i in range(nodes)]
    return [algorithm_default_spec(algorithm, input_shape, num_classes, size)] * nodes


def _layers(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    t = spec.get("type")
    key = {"cnn1d": "channels", "cnn": "widths", "mlp": "hidden", "convdense": "conv", "resnet": "widths"}.get(str(t))
    return (t, len(spec.get(key, ())) if key else None, len(spec.get("dense", ())) if t == "convdense" else None)


def check_algorithm_models(algorithm: str, specs: Sequence[Mapping[str, Any]]) -> None:
    """Check that ``algorithm`` can train the models ``specs`` (one per node, or one).

    Raises:
        ValueError: one line naming the algorithm, the model and the fix.
    """
    types = sorted({str(s.get("type")) for s in specs})
    if algorithm in LAYERED and types != ["convdense"]:
        raise ValueError(f"{algorithm} needs the layered 'convdense' model, got {', '.join(types)}: leave the "
                         "model unset for its default, or give a spec with \"type\": \"convdense\"")
    if algorithm in WIDTH_SCALED and len({_layers(s) for s in specs}) > 1:
        raise ValueError(f"{algorithm} needs width-scaled members of one model family (same type and depth), "
                         f"got {', '.join(types)} of different depths: leave the model unset (H1 in the "
                         "simulator, the profile's tier on devices) or use --models H1")
