"""The default models, and the check that a chosen model suits an algorithm.

Each algorithm declares which default model it trains (its trait ``default_model``,
:class:`dfl_agent.algorithms.base.Traits`; the runtime reads it from the registry and
passes it here, so this module knows no algorithm):

- ``tier``: any model; the default is :func:`dfl_agent.models.default_spec` for the data
  set's input shape and the size tier.
- ``layered`` (FedD2S distils layer by layer): the layered ``convdense`` model
  (:mod:`dfl_agent.models.convdense`); the default is the seed's M1 widths
  ``conv [8, 16, 32], dense [32, 16]`` scaled by the size tier (×½ small, ×2 large).
- ``width-scaled`` (HeteroFL, FedRolex: partial training aggregates width-scaled members
  of one family): in the simulator DFML's H1 family (:mod:`dfl_agent.models.families`,
  widths 1, ½, ¼, ⅛, 1/16 spread over the nodes); on a device the default model of the
  profile's tier (one family scaled in width).

:func:`check_models` turns an unsuitable forced model into one line that names the fix
(``ValueError``), instead of a traceback deep in training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dfl_agent.models import default_spec, validate_spec

#: The default models (an algorithm's trait ``default_model``).
DEFAULT_MODELS = ("tier", "layered", "width-scaled")
_SCALE = {"small": 0.5, "medium": 1.0, "large": 2.0}


def _check_kind(default_model: str) -> None:
    if default_model not in DEFAULT_MODELS:
        raise ValueError(f"default model must be one of {DEFAULT_MODELS}, got {default_model!r}")


def default_model_spec(default_model: str, input_shape: Sequence[int], num_classes: int,
                       size: str = "medium") -> dict[str, Any]:
    """The spec of the default model ``default_model`` (one of :data:`DEFAULT_MODELS`) for
    inputs of ``input_shape`` (one node) and the size tier ``size``.

    Raises:
        ValueError: unknown default model or size tier.
    """
    _check_kind(default_model)
    if size not in _SCALE:
        raise ValueError(f"model size must be one of {sorted(_SCALE)}, got {size!r}")
    shape = list(input_shape)
    if default_model == "layered" and len(shape) in (2, 3):
        f = _SCALE[size]
        return validate_spec({"type": "convdense", "input_shape": shape,
                              "conv": [max(4, int(w * f)) for w in (8, 16, 32)],
                              "dense": [max(4, int(w * f)) for w in (32, 16)], "num_classes": num_classes})
    return default_spec(shape, num_classes, size)


def default_model_specs(default_model: str, input_shape: Sequence[int], num_classes: int, nodes: int,
                        size: str = "medium") -> list[dict[str, Any]]:
    """One spec per node for a simulation that chooses no model: H1 spread over the nodes
    for ``width-scaled`` (on inputs H1 supports), else :func:`default_model_spec` for every
    node.

    Raises:
        ValueError: unknown default model or size tier.
    """
    _check_kind(default_model)
    if default_model == "width-scaled":
        from dfl_agent.models.families import family_specs

        try:
            fam = family_specs("H1", input_shape, num_classes)
        except ValueError:
            fam = []
        if fam:
            return [fam[i % len(fam)] for i in range(nodes)]
    return [default_model_spec(default_model, input_shape, num_classes, size)] * nodes


def _layers(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    t = spec.get("type")
    key = {"cnn1d": "channels", "cnn": "widths", "mlp": "hidden", "convdense": "conv", "resnet": "widths"}.get(str(t))
    return (t, len(spec.get(key, ())) if key else None, len(spec.get("dense", ())) if t == "convdense" else None)


def check_models(default_model: str, algorithm: str, specs: Sequence[Mapping[str, Any]]) -> None:
    """Check that an algorithm whose default model is ``default_model`` can train the models
    ``specs`` (one per node, or one); ``algorithm`` names it in the message.

    Raises:
        ValueError: one line naming the algorithm, the model and the fix; an unknown
            default model.
    """
    _check_kind(default_model)
    types = sorted({str(s.get("type")) for s in specs})
    if default_model == "layered" and types != ["convdense"]:
        raise ValueError(f"{algorithm} needs the layered 'convdense' model, got {', '.join(types)}: leave the "
                         "model unset for its default, or give a spec with \"type\": \"convdense\"")
    if default_model == "width-scaled" and len({_layers(s) for s in specs}) > 1:
        raise ValueError(f"{algorithm} needs width-scaled members of one model family (same type and depth), "
                         f"got {', '.join(types)} of different depths: leave the model unset (H1 in the "
                         "simulator, the profile's tier on devices) or use --models H1")
