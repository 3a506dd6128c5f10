"""The agent's side of the sample store (:mod:`dfl_agent.store`): schema from the configuration, seeding,
run snapshots, the training/validation split, and the periodic spool pass.  Torch-free."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.durations import parse_optional_duration
from dfl_agent.store.sqlite import (
    SampleStore,
    Schema,
    StoreError,
    validation_mask,
)

log = logging.getLogger(__name__)

#: key of the run's snapshot (sample ids) in ``ctx.persistent_state`` (saved with checkpoints)
SNAPSHOT_KEY = "store_snapshot"


def schema_from_config(cfg: Any) -> Schema | None:
    """The store schema from ``[data]`` (input_shape + num_classes/class_names), else from
    ``data.path/meta.json``; None when neither is given (an existing store has its own).

    Raises:
        StoreError: invalid values, naming the key or file.
    """
    d = cfg.data
    if d.input_shape is not None:
        names = tuple(d.class_names or ())
        return Schema(tuple(d.input_shape), int(d.num_classes or len(names)), names)
    if d.path is not None and (Path(d.path) / "meta.json").is_file():
        return Schema.from_meta(Path(d.path) / "meta.json")
    return None


def check_schema(cfg: Any) -> Schema | None:
    """The store schema of ``cfg`` (:func:`schema_from_config`), its errors as a
    :class:`~dfl_agent.runtime.shared.config.ConfigError` that starts with the key.

    The one check of ``data.input_shape``, ``data.num_classes`` and ``data.class_names``
    (or ``data.path``'s ``meta.json``): ``dfl-agent check-config`` and ``dfl-agent run``
    (its start-up checks and :func:`open_store`) both call it, so a bad value fails both
    the same way (exit 2).

    Raises:
        ConfigError: ``data.input_shape: ...`` (an empty list or a size < 1),
            ``data.num_classes: ...``, ``data.class_names: N names for num_classes=K``, or
            ``data.path: DIR/meta.json: ...`` (unreadable, missing keys).
    """
    from dfl_agent.runtime.shared.config import ConfigError

    try:
        return schema_from_config(cfg)
    except (StoreError, ValueError, TypeError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("data.") else f"data.path: {msg}") from None


def open_store(cfg: Any, *, create: bool = True) -> SampleStore:
    """The agent's :class:`SampleStore` under ``cfg.state_dir`` with the ``[data]`` limits.

    Raises:
        ConfigError: an invalid schema in the configuration (:func:`check_schema`).
        StoreError: no schema for a new store, or a mismatch with the stored one.
    """
    d = cfg.data
    return SampleStore(cfg.state_dir, check_schema(cfg), spool_dir=d.spool_dir,
                       max_samples=d.store_max_samples, max_age=parse_optional_duration(d.store_max_age),
                       max_per_class=d.store_max_per_class, eviction=d.store_eviction, create=create,
                       max_ingest_bytes=d.store_max_ingest_bytes)


def seed_store(store: SampleStore, path: str | None) -> int:
    """Seed the store from an ``npz`` data directory (``path/train.npz``) once in its life
    (:meth:`~dfl_agent.store.sqlite.SampleStore.seed`): at the first start of the agent,
    always-on or ``--once``; a later start ingests nothing, even from another file.
    Returns the samples added.

    Raises:
        StoreError: the seed file was rejected (its reason; nothing is recorded).
        OSError: the seed file cannot be read.
    """
    if path is None or not (Path(path) / "train.npz").is_file():
        return 0
    seed = Path(path) / "train.npz"
    res = store.seed(seed)
    if res["status"] == "rejected":
        raise StoreError(f"{seed}: {res['reason']}")
    if res["status"] == "seeded_before":
        log.debug("the sample store was seeded from %s before; %s is not ingested again", res["seed"].get("name"), seed)
    elif res["samples"]:
        log.info("seeded the sample store with %d samples from %s (once: a restart does not ingest it again)",
                 res["samples"], seed)
    return int(res["samples"])


def store_data(store: SampleStore, ids: np.ndarray, validation_share: float) -> tuple[Any, Any]:
    """``(DatasetBundle, NodeData)`` of the snapshot ``ids``: the validation slice (by hash of
    the id) is both the node's validation split and the bundle's test set (the store has no
    global test set; accuracies are local validation accuracies).

    Raises:
        StoreError: the snapshot has no training sample.
    """
    from dfl_agent.data.dataset import Dataset, DatasetBundle, NodeData

    ids = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    val = validation_mask(ids, validation_share)  # per id: the slice does not depend on what was evicted
    s = store.schema

    def ds(part: np.ndarray) -> Dataset:  # each split loaded into its own array: no copy of the whole snapshot
        _, x, y, g = store.load(part)
        return Dataset("store", x, y, g, s.num_classes, list(s.class_names), s.input_shape)

    train, test = ds(ids[~val]), ds(ids[val])
    if len(train.y) == 0:
        raise StoreError(f"the sample store holds no training samples ({len(train.y) + len(test.y)} in the "
                         f"snapshot); add .npz files to {store.spool_dir} or run 'dflctl data add'")
    data = NodeData(train_x=train.x, train_y=train.y, val_x=test.x, val_y=test.y, num_classes=s.num_classes,
                    input_shape=s.input_shape, class_names=list(s.class_names),
                    groups=sorted(int(u) for u in np.unique(np.concatenate([train.groups, test.groups])) if u >= 0))
    return DatasetBundle(pool=train, test=test), data
