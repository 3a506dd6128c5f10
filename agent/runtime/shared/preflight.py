"""Start-up checks of a node configuration that need more than the file itself.

:func:`check_startup` runs every check that ``dfl-agent run`` runs before it touches the
network: the algorithm and its options, the device profile, the data set (its name, its
directory, and, with ``load_data``, its files and the model it implies), the static peers
and the node's key and certificate.  It writes nothing: no state directory, no key.
``dfl-agent check-config`` and ``dfl-agent run`` both call it, and the daemon uses the
same helpers (:mod:`dfl_agent.runtime.shared.assembly`, :func:`load_data`), so that a bad configuration
fails the same way, as one line naming the key (:class:`ConfigError`), in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dfl_agent.runtime.shared.assembly import apply_profile, check_node_model, model_spec_for, resolve_algorithm
from dfl_agent.runtime.shared.config import ConfigError, NodeConfig


def check_data_path(cfg: NodeConfig) -> None:
    """``data.path``, when set, is an existing directory.

    Raises:
        ConfigError: ``data.path: ... does not exist`` or ``... is a file, not a directory``.
    """
    if cfg.data.path is None:
        return
    p = Path(cfg.data.path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path: {p} does not exist (a data directory is expected)")
    if not p.is_dir():
        raise ConfigError(f"data.path: {p} is a file, not a directory (give the directory that holds the data)")


def load_data(cfg: NodeConfig) -> Any:
    """Load ``data.dataset`` (not the sample store) as the daemon does.

    Returns:
        the :class:`~dfl_agent.data.dataset.DatasetBundle`.
    Raises:
        ConfigError: ``data.dataset: unknown dataset ...`` (or one whose optional
            package is not installed), ``data.path: ...`` (missing, a file, unreadable or
            invalid data files, named).
    """
    from dfl_agent.data import load_dataset
    from dfl_agent.data.loading import DATASETS

    d = cfg.data
    if d.dataset not in DATASETS:
        raise ConfigError(f"data.dataset: unknown dataset {d.dataset!r}; known: {', '.join(DATASETS)}")
    check_data_path(cfg)
    try:
        return load_dataset(d.dataset, path=d.path, cache_dir=d.cache_dir)
    except ImportError as exc:  # an optional package of the data set (e.g. the 'har' extra)
        raise ConfigError(f"data.dataset: {d.dataset!r} needs a package that is not installed: {exc}") from None
    except (OSError, ValueError, LookupError) as exc:
        raise ConfigError(f"{'data.path' if d.path is not None else 'data.dataset'}: {exc}") from None


def data_shape(cfg: NodeConfig) -> tuple[tuple[int, ...], int]:
    """``(input_shape, num_classes)`` of ``data.dataset`` (not the sample store), as
    :func:`load_data` would find them, for the start-up's model checks.

    HAR's converted cache is described from its array headers
    (:func:`dfl_agent.data.har.inspect_har`: shapes, dtypes, counts, labels; its sample
    windows are not read); every other data set, or a HAR cache that is missing or fails
    a check, is loaded by :func:`load_data`, so the errors are the same.

    Raises:
        ConfigError: as :func:`load_data`.
    """
    d = cfg.data
    if d.dataset == "har" and d.path is None:
        from dfl_agent.data.har import inspect_har

        summary = inspect_har(d.cache_dir)
        if summary is not None:
            return tuple(summary["input_shape"]), int(summary["num_classes"])
    pool = load_data(cfg).pool
    return tuple(pool.input_shape), int(pool.num_classes)


def _check_security(cfg: NodeConfig) -> None:
    """The node's key (``security.key_file`` or the state directory's) and certificate,
    where they exist already; nothing is created."""
    from dfl_agent.security import SecurityError, TrustStore
    from dfl_agent.security.keys import CERT_FILE, KEY_FILE, load_certificate, load_private_key

    sec = cfg.security
    state = Path(cfg.state_dir)
    key_path = Path(sec.key_file) if sec.key_file else state / KEY_FILE
    if key_path.exists():
        try:
            load_private_key(key_path)
        except SecurityError as exc:
            raise ConfigError(f"security.key_file: {exc}") from None
    cert_path = Path(sec.certificate) if sec.certificate else state / CERT_FILE
    if not cert_path.exists():
        return
    key = "security.certificate" if sec.certificate else "state_dir"
    try:
        cert = load_certificate(cert_path)
        if sec.federation_key is not None:
            trust = TrustStore(cfg.federation, None, sec.federation_key)
            node = trust.add_certificate(cert)
            nid = cfg.node_id
            if nid is None and (state / "node_id").is_file():
                nid = (state / "node_id").read_text(encoding="utf-8").strip() or None
            if nid is not None and node != nid:
                raise SecurityError(f"certificate {cert_path} is for node {node!r}, not {nid!r}")
    except (SecurityError, OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


def check_startup(cfg: NodeConfig, *, load: bool = True) -> None:
    """Every check ``dfl-agent run`` makes before it touches the network; writes nothing.

    ``load=False`` leaves out loading the data set's files and the model checks that need
    them (the daemon loads the data itself right after).  With ``load``, the data set is
    described by :func:`data_shape` (HAR from its cache's array headers) and the model
    is checked from its spec (its size by
    :func:`dfl_agent.models.spec_param_count`): torch is not imported for the
    built-in data sets and the ``cnn1d``, ``mlp`` and ``cnn`` models.  The sample store
    (``data.dataset = "store"``) is not opened here; its schema from ``[data]`` (or
    ``data.path``'s ``meta.json``) is checked as ``run`` checks it
    (:func:`dfl_agent.runtime.shared.sample_store.check_schema`).

    Raises:
        ConfigError: one line naming the offending key.
    """
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.discovery.static import load_static_peers

    try:
        load_static_peers(PeerTable(cfg.node_id or "check-config", cfg.federation), cfg.discovery.static_peers,
                          cfg.federation)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"discovery.static_peers: {exc}") from None
    d = cfg.data
    if d.dataset != "store":
        from dfl_agent.data.loading import DATASETS

        if d.dataset not in DATASETS:
            raise ConfigError(f"data.dataset: unknown dataset {d.dataset!r}; known: {', '.join((*DATASETS, 'store'))}")
    check_data_path(cfg)
    if d.dataset == "store":  # the schema check open_store makes at the start, without opening the store
        from dfl_agent.runtime.shared.sample_store import check_schema

        check_schema(cfg)
    _check_security(cfg)
    try:
        algo_cls, _options = resolve_algorithm(cfg)
    except ImportError as exc:  # a torch-free install: the training agent cannot run here at all
        raise ConfigError(f"algorithm.name: the training agent needs the 'train' extra (torch): {exc}") from None
    try:
        profile, behaviour = apply_profile(cfg, algo_cls.name)
    except (ValueError, LookupError) as exc:
        raise ConfigError(f"profile: {exc}") from None
    if not load or d.dataset == "store":
        return
    input_shape, num_classes = data_shape(cfg)
    try:
        spec = model_spec_for(cfg, algo_cls.name, input_shape, num_classes,
                              profile_size=profile.model.size, tier=behaviour.model_size)
        check_node_model(algo_cls.name, spec, num_classes)
        apply_profile(cfg, algo_cls.name, spec=spec)  # the aggregator's memory check
    except (ValueError, KeyError, LookupError) as exc:
        raise ConfigError(f"model: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}") from None
