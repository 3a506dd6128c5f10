"""Load a deployed model into torch: :func:`load_deployed`.

The agent deploys each model as a version folder under ``STATE_DIR/models``
(``models/v7/``, with ``models/current`` a symlink to the deployed one; the contract is
``dfl_agent/deploy/FORMAT.md``).  A version always holds ``spec.json`` (the model spec,
``input_shape``, ``class_names``) and ``model.safetensors`` (the state dict), and
``model.onnx`` when the agent has the ``onnx`` extra.  An application with torch loads
the first two with :func:`load_deployed`; one without torch runs ``model.onnx`` with
onnxruntime.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dfl_agent.fsutil import sha256_file
from dfl_agent.jsonbound import loads as bounded_loads

__all__ = ["DeployedModelError", "load_deployed"]


class DeployedModelError(ValueError):
    """A deployed version folder is unusable: a bad ``spec.json``, an unreadable
    ``model.safetensors``, tensors that do not fit the spec's model, or a file whose
    SHA-256 differs from ``manifest.json``.  The message names the file."""


def _resolve(path: str | os.PathLike[str]) -> Path:
    """The real version folder: ``path`` itself, or ``path/current`` for a ``models`` folder."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such deployed model folder")
    if not p.is_dir():
        raise NotADirectoryError(f"{p}: not a folder (give a version folder such as models/current)")
    if not (p / "spec.json").exists() and (p / "current").exists():
        p = p / "current"
    return Path(os.path.realpath(p))  # resolve once: `current` may switch between two reads


def _check_manifest(folder: Path, names: tuple[str, ...]) -> None:
    """Each of ``names`` matches its SHA-256 in ``manifest.json`` (when the folder has one)."""
    if not (folder / "manifest.json").exists():
        return
    try:
        manifest = bounded_loads((folder / "manifest.json").read_bytes(), "manifest")
    except (OSError, ValueError) as exc:
        raise DeployedModelError(f"{folder / 'manifest.json'}: unreadable ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise DeployedModelError(f"{folder / 'manifest.json'}: no 'files' table")
    for name in names:
        info = files.get(name)
        if not isinstance(info, dict) or sha256_file(folder / name) != info.get("sha256"):
            raise DeployedModelError(f"{folder / name}: SHA-256 differs from manifest.json (not this version's file)")


def _read_spec(folder: Path) -> dict[str, Any]:
    from dfl_agent.models import SpecError, validate_spec

    path = folder / "spec.json"
    try:
        meta = bounded_loads(path.read_bytes(), "manifest")
    except ValueError as exc:
        raise DeployedModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict):
        raise DeployedModelError(f"{path}: no 'spec' object (the model spec)")
    try:
        spec = validate_spec(meta["spec"])
    except SpecError as exc:
        raise DeployedModelError(f"{path}: bad model spec: {exc}") from None
    if "num_classes" in meta and meta["num_classes"] != spec["num_classes"]:
        raise DeployedModelError(
            f"{path}: num_classes {meta['num_classes']!r} differs from the spec's {spec['num_classes']}")
    return spec


def load_deployed(path: str | os.PathLike[str], *, verify: bool = True) -> Any:
    """The torch model of a deployed version, in eval mode on the CPU.

    Args:
        path: a version folder (``STATE_DIR/models/v7``), the ``STATE_DIR/models/current``
            link, or the ``STATE_DIR/models`` folder itself (its ``current`` is used).
            A link is resolved once, so both files come from the same version even if
            ``current`` switches meanwhile.
        verify: check ``spec.json`` and ``model.safetensors`` against the SHA-256 in the
            folder's ``manifest.json`` (skipped when there is no manifest).

    Returns:
        A ``torch.nn.Module`` built from ``spec.json``'s ``spec`` (see
        :func:`dfl_agent.models.build_model`) with the weights of ``model.safetensors``.
        It maps float32 ``(B, *input_shape)`` to logits ``(B, num_classes)``;
        ``input_shape`` and ``class_names`` are in ``spec.json``.

    Raises:
        FileNotFoundError: ``path``, ``spec.json`` or ``model.safetensors`` does not exist
            (the message names it).
        NotADirectoryError: ``path`` is a file.
        DeployedModelError: (a ``ValueError``) ``spec.json`` is not JSON or has no valid
            model spec; ``model.safetensors`` is unreadable, lacks a tensor of the spec's
            model, has an extra one, or one of another shape (named with both shapes);
            a file does not match ``manifest.json``.
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dfl_agent.models import build_model

    folder = _resolve(path)
    for name in ("spec.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing (a deployed version holds spec.json and "
                                    "model.safetensors)")
    if verify:
        _check_manifest(folder, ("spec.json", "model.safetensors"))
    spec = _read_spec(folder)
    weights = folder / "model.safetensors"
    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise DeployedModelError(f"{weights}: unreadable safetensors file ({exc})") from None
    with torch.random.fork_rng(devices=[]):  # building initialises weights; leave the caller's RNG alone
        model = build_model(spec)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise DeployedModelError(f"{weights}: tensors do not match the {spec['type']} model of spec.json "
                                 f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for key, ref in want.items():
        got = state[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise DeployedModelError(f"{weights}: tensor {key!r} has shape {list(got.shape)}, the spec's model "
                                     f"needs {list(ref.shape)}")
        if ref.is_floating_point() != got.is_floating_point():
            raise DeployedModelError(f"{weights}: tensor {key!r} has dtype {got.dtype}, the spec's model "
                                     f"needs {ref.dtype}")
    model.load_state_dict(state)
    return model.eval()
