"""The checks of a node's configuration (:func:`validate`), after its types were checked:
ranges, combinations and files, section by section; each raises
:class:`~dfl_agent.runtime.shared.config.ConfigError` naming the first offending key."""

from __future__ import annotations

import os
import re

from dfl_agent.privacy.config import merge_privacy
from dfl_agent.privacy.policy import DPSupport, parse_checked
from dfl_agent.runtime.shared.config import MODEL_FAMILIES, ConfigError, NodeConfig


def _need(ok: bool, key: str, why: str) -> None:
    """Raise ``ConfigError("{key}: {why}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {why}")


def validate(cfg: NodeConfig) -> None:
    """Check every value of ``cfg`` section by section, in a fixed order (ConfigError naming the first offending key)."""
    for check in (_validate_run, _validate_training, _validate_data, _validate_model, _validate_mqtt,
                  _validate_security, _validate_runtime):
        check(cfg)


def _validate_run(cfg: NodeConfig) -> None:
    """Ids, rounds and the recurrence of the default run (ConfigError naming the first offending key)."""
    from dfl_agent.transport.wire import valid_id

    _need(valid_id(cfg.federation), "federation", "must match [A-Za-z0-9_.-]{1,64}")
    _need(cfg.node_id is None or valid_id(cfg.node_id), "node_id", "must match [A-Za-z0-9_.-]{1,64}")
    _need(cfg.algorithm.rounds >= 1, "algorithm.rounds", "must be >= 1")
    if cfg.algorithm.every is not None:
        from dfl_agent.durations import parse_duration

        try:
            parse_duration(cfg.algorithm.every)
        except ValueError as exc:
            _need(False, "algorithm.every", str(exc))
    if cfg.algorithm.every_samples is not None:
        _need(cfg.algorithm.every_samples >= 1, "algorithm.every_samples", "must be >= 1")
        _need(cfg.data.dataset == "store", "algorithm.every_samples",
             "needs the sample store (data.dataset = \"store\")")
        _need(cfg.algorithm.every is None, "algorithm.every_samples", "set algorithm.every or every_samples, not both")


def _validate_training(cfg: NodeConfig) -> None:
    """``[training]`` (ConfigError naming the first offending key)."""
    t = cfg.training
    _need(t.epochs >= 1, "training.epochs", "must be >= 1")
    _need(isinstance(t.steps, int) and t.steps >= 0, "training.steps", "must be an integer >= 0 (0: use epochs)")
    _need(t.batch_size is None or t.batch_size >= 1, "training.batch_size", "must be >= 1")
    _need(t.lr is None or t.lr > 0, "training.lr", "must be > 0")
    _need(0 <= t.momentum < 1, "training.momentum", "must be in [0, 1)")
    _need(t.weight_decay >= 0, "training.weight_decay", "must be >= 0")
    _need(t.clip_grad_norm >= 0, "training.clip_grad_norm", "must be >= 0 (0: off)")
    _need(t.divergence_factor == 0 or t.divergence_factor > 1, "training.divergence_factor", "must be 0 (off) or > 1")
    _need(isinstance(t.warm_start_ramp, int) and t.warm_start_ramp >= 0, "training.warm_start_ramp", "must be >= 0")
    _need(t.threads is None or t.threads >= 1, "training.threads", "must be >= 1")
    _need(t.device is None or t.device in ("cpu", "auto") or re.fullmatch(r"cuda(:\d+)?", t.device) is not None,
         "training.device", "must be 'cpu', 'auto' or 'cuda[:N]'")


def _validate_data(cfg: NodeConfig) -> None:
    """``[data]`` and the sample store (ConfigError naming the first offending key)."""
    d = cfg.data
    _need(d.num_nodes >= 1, "data.num_nodes", "must be >= 1")
    _need(0 <= d.node_index < d.num_nodes, "data.node_index", f"must be in [0, data.num_nodes={d.num_nodes})")
    _need(d.beta > 0, "data.beta", "must be > 0")
    _need(d.zeta >= 1, "data.zeta", "must be >= 1")
    _need(d.dataset != "store" or d.path is not None or ((d.input_shape is not None and bool(d.num_classes))
         or d.class_names is not None), "data.input_shape",
         "the store needs data.input_shape and data.num_classes (or data.path with a meta.json)")
    _need(d.store_max_samples >= 1, "data.store_max_samples", "must be >= 1")
    _need(d.store_max_per_class >= 0, "data.store_max_per_class", "must be >= 0 (0 = no cap)")
    _need(d.store_eviction in ("oldest", "largest-class"), "data.store_eviction", "must be 'oldest' or 'largest-class'")
    _need(d.store_max_ingest_bytes >= 1, "data.store_max_ingest_bytes", "must be >= 1")
    _need(0 <= d.validation_share < 1, "data.validation_share", "must be in [0, 1)")
    _need(d.spool_interval > 0, "data.spool_interval", "must be > 0 seconds")
    try:
        from dfl_agent.durations import parse_optional_duration

        parse_optional_duration(d.store_max_age)
    except ValueError as exc:
        raise ConfigError(f"data.store_max_age: {exc}") from None


def _validate_model(cfg: NodeConfig) -> None:
    """``[deploy]``, ``[model]`` and the device profile (ConfigError naming the first offending key)."""
    _need(cfg.deploy.tolerance >= 0, "deploy.tolerance", "must be >= 0 (accuracy as a fraction)")
    _need(cfg.deploy.keep >= 1, "deploy.keep", "must be >= 1")
    _need(cfg.deploy.min_validation >= 0, "deploy.min_validation", "must be >= 0")
    _need(cfg.model.size is None or cfg.model.size in ("small", "medium", "large"), "model.size",
         "must be small, medium or large")
    _need(cfg.model.family is None or cfg.model.family in MODEL_FAMILIES, "model.family",
         f"must be one of {', '.join(MODEL_FAMILIES)}")
    _need(cfg.model.family is None or cfg.model.spec is None, "model.family", "set model.family or model.spec, not both")
    _validate_profile(cfg)


def _validate_mqtt(cfg: NodeConfig) -> None:
    """``[mqtt]`` and ``[discovery]`` (ConfigError naming the first offending key)."""
    from dfl_agent.transport.link_rate import derive

    m = cfg.mqtt
    _need(m.protocol in ("5", "3.1.1"), "mqtt.protocol", "must be '5' or '3.1.1'")
    _need(m.chunk_size is None or m.chunk_size >= 1024, "mqtt.chunk_size", "must be >= 1024")
    try:
        chunk = derive(m.link_rate, chunk_size=m.chunk_size).chunk_size
    except ValueError as exc:
        raise ConfigError(f"mqtt.link_rate: {exc}") from None
    _need(m.max_frame_bytes >= chunk, "mqtt.max_frame_bytes", "must be >= mqtt.chunk_size")
    _need(m.keepalive is None or m.keepalive >= 1, "mqtt.keepalive", "must be >= 1")
    _need(m.heartbeat_interval > 0, "mqtt.heartbeat_interval", "must be > 0")
    from dfl_agent.transport.endpoint import valid_endpoint

    _need(valid_endpoint(m.broker), "mqtt.broker", "must be 'host:port' (IPv6: '[addr]:port')")
    disc = cfg.discovery
    _need(not disc.mdns or bool(disc.interfaces), "discovery.interfaces",
         "must list at least one interface address when mdns is on (e.g. ['127.0.0.1'])")
    _need(disc.min_peers >= 0, "discovery.min_peers", "must be >= 0")
    _need(disc.start_timeout > 0, "discovery.start_timeout", "must be > 0")
    _need(disc.heartbeat_timeout > 0, "discovery.heartbeat_timeout", "must be > 0")


def _validate_security(cfg: NodeConfig) -> None:
    """Static peers, ``[security]`` and the MQTT limits and TLS files (ConfigError naming the first offending key)."""
    from dfl_agent.discovery.static import parse_peer
    from dfl_agent.transport.wire import valid_id

    m = cfg.mqtt
    sp = cfg.discovery.static_peers
    _need(isinstance(sp, (list, tuple)), "discovery.static_peers", "must be a list")
    for i, entry in enumerate(sp):
        try:
            parse_peer(entry)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"discovery.static_peers[{i}]: {exc}") from None
    sec = cfg.security
    _need(sec.replay_window > 0, "security.replay_window", "must be > 0 seconds")
    _need(sec.max_queued_per_sender >= 1, "security.max_queued_per_sender", "must be >= 1")
    _need(m.max_transfers >= 1, "mqtt.max_transfers", "must be >= 1")
    _need(m.tls_cert is None or m.tls_ca is not None, "mqtt.tls_cert", "needs mqtt.tls_ca")
    _need((m.tls_cert is None) == (m.tls_key is None), "mqtt.tls_key", "mqtt.tls_cert and mqtt.tls_key go together")
    for key in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(m, key)
        _need(path is None or os.path.isfile(path), f"mqtt.{key}", f"file not found: {path}")
    from dfl_agent.security.keys import SecurityError, parse_public_key

    for table in ("trusted_keys", "operators"):
        for nid, text in getattr(sec, table).items():
            _need(valid_id(nid), f"security.{table}.{nid}", "must be a valid node id")
            try:
                parse_public_key(text if isinstance(text, str) else "")
            except SecurityError as exc:
                raise ConfigError(f"security.{table}.{nid}: {exc}") from None
    if sec.federation_key is not None:
        try:
            parse_public_key(sec.federation_key)
        except SecurityError as exc:
            raise ConfigError(f"security.federation_key: {exc}") from None
    _need(not sec.require_signatures or bool(sec.trusted_keys) or sec.federation_key is not None,
         "security.require_signatures", "needs security.federation_key or security.trusted_keys")
    _need(sec.certificate is None or os.path.isfile(sec.certificate), "security.certificate",
         f"file not found: {sec.certificate}")


def _validate_runtime(cfg: NodeConfig) -> None:
    """``[runtime]`` and ``[compression]`` (ConfigError naming the first offending key)."""
    _need(cfg.runtime.init in ("common", "independent"), "runtime.init", "must be 'common' or 'independent'")
    _need(cfg.runtime.log_level.lower() in ("debug", "info", "warning", "error"), "runtime.log_level",
         "must be debug, info, warning or error")
    _need(cfg.runtime.checkpoint_keep >= 1, "runtime.checkpoint_keep", "must be >= 1 (2 keeps a fallback)")
    _need(cfg.runtime.log_format in ("auto", "text", "journal"), "runtime.log_format", "must be auto, text or journal")
    _need(0 <= cfg.runtime.prometheus_port <= 65535, "runtime.prometheus_port", "must be in [0, 65535] (0 = off)")
    for key, low in (("max_catch_up_rounds", 0), ("run_retries", 0), ("eval_every", 1), ("keep_runs", 1),
                     ("disk_warn_mb", 0)):
        v = getattr(cfg.runtime, key)
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= low, f"runtime.{key}", f"must be an integer >= {low}")
    _need(cfg.runtime.run_stop_grace > 0, "runtime.run_stop_grace", "must be > 0 seconds")
    _need(cfg.runtime.run_init in ("deployed", "fresh"), "runtime.run_init", "must be 'deployed' or 'fresh'")
    _need(cfg.runtime.straggler in ("quorum", "paper"), "runtime.straggler", "must be 'quorum' or 'paper'")
    _need(0 < cfg.runtime.min_round_timeout <= cfg.runtime.max_round_timeout, "runtime.min_round_timeout",
          "must be > 0 and <= runtime.max_round_timeout")
    from dfl_agent.learning.compression import CompressionError, parse_spec

    c = cfg.compression
    for key, spec in [("compression.spec", c.spec)] + [(f"compression.kinds.{k}", v) for k, v in c.kinds.items()]:
        try:
            parse_spec(spec)
        except CompressionError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    _need(c.consensus_step >= 0, "compression.consensus_step", "must be >= 0 (0 = automatic)")
    _need(isinstance(c.keyframe_every, int), "compression.keyframe_every",
         "must be an integer (0: automatic, < 0: first message only)")


def _validate_profile(cfg: NodeConfig) -> None:
    """``profile`` names a known profile (or ``auto``); ``profile_overrides`` are valid fields."""
    from dfl_agent.profiles import AUTO, DeviceProfile, ProfileError, get_profile, with_overrides

    try:
        base = DeviceProfile(name="override-check") if cfg.profile == AUTO else get_profile(cfg.profile)
    except ProfileError as exc:
        raise ConfigError(f"profile: {exc}") from None
    try:  # [privacy]: the node's keys over the profile's, validated together; under DP, the algorithm's messages
        parse_checked(merge_privacy(with_overrides(base, cfg.profile_overrides).privacy, cfg.privacy),
                      cfg.algorithm.name, _dp_support(cfg.algorithm.name), cfg.algorithm.options)
    except ValueError as exc:  # ProfileError too
        raise ConfigError(str(exc)) from None


def _dp_support(algorithm: str) -> DPSupport | None:
    """The registered ``algorithm``'s DP declaration (``traits.dp``; None for an unknown name,
    which the algorithm's own check reports)."""
    from dfl_agent.algorithms.base import get_algorithm

    try:
        return get_algorithm(algorithm).traits.dp
    except KeyError:
        return None
