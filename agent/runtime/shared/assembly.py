"""Assembling a node: the one place that turns a configuration into a running node.

The daemon (one node over MQTT), the simulator (N nodes over the memory transport) and
the start-up checks (:mod:`dfl_agent.runtime.shared.preflight`) all go through this module:

- :func:`resolve_algorithm` — the algorithm class and its parsed options;
- :func:`apply_profile` — the device profile and its behaviour (decision table);
- :func:`choose_model_specs` — the one rule that picks each node's model spec
  (:func:`model_spec_for` is the rule for one device);
- :func:`check_node_model` — the model suits the algorithm and the data;
- :func:`choose_compression` — the node's compression policy;
- :func:`link_settings` — transport settings, round deadline and heartbeat timeout for ``mqtt.link_rate``;
- :func:`build_security` — the node's key, certificate and trust store;
The node itself is assembled by :func:`~dfl_agent.runtime.node.build.build_node` (a complete
:class:`~dfl_agent.runtime.node.context.RuntimeContext` and its :class:`~dfl_agent.runtime.node.node.Node`).

Nothing here imports torch at module level.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.runtime.shared.config import ConfigError, NodeConfig

if TYPE_CHECKING:
    from dfl_agent.algorithms.base import Algorithm
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy
    from dfl_agent.learning.compression import CompressionPolicy
    from dfl_agent.profiles.behaviour import Behaviour
    from dfl_agent.profiles.schema import DeviceProfile
    from dfl_agent.security.trust import SecurityGuard
    from dfl_agent.transport.link_rate import LinkTimings

log = logging.getLogger("dfl_agent.daemon")


class StartupError(RuntimeError):
    """The agent cannot start: unknown algorithm or option, unusable data or model spec."""


def resolve_algorithm(cfg: NodeConfig) -> tuple[type[Algorithm], Any]:
    """The algorithm class of ``algorithm.name`` and its parsed ``algorithm.options``, as
    ``runtime.straggler`` runs them (:func:`~dfl_agent.algorithms.protocols.stragglers.quorum_options`).

    Raises:
        ConfigError: ``algorithm.name: unknown algorithm ...`` or
            ``algorithm.options.KEY: ...`` (unknown option, wrong type, bad value).
        ImportError: the algorithms need the ``train`` extra (torch), not installed.
    """
    from dfl_agent.algorithms.base import get_algorithm, parse_options

    try:
        algo_cls = get_algorithm(cfg.algorithm.name)
    except KeyError as exc:
        raise ConfigError(f"algorithm.name: {exc.args[0] if exc.args else exc}") from None
    try:
        options = parse_options(algo_cls, cfg.algorithm.options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from dfl_agent.algorithms.protocols.stragglers import quorum_options

    return algo_cls, quorum_options(options, straggler_policy(cfg), cfg.algorithm.options)


def straggler_policy(cfg: NodeConfig) -> StragglerPolicy:
    """The node's :class:`~dfl_agent.algorithms.protocols.stragglers.StragglerPolicy`
    (``runtime.straggler``, ``min_round_timeout``, ``max_round_timeout``)."""
    from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy

    r = cfg.runtime
    return StragglerPolicy(r.straggler, r.min_round_timeout, r.max_round_timeout)


def apply_profile(cfg: NodeConfig, algorithm: str, spec: dict[str, Any] | None = None) -> tuple[DeviceProfile, Behaviour]:
    """The node's device profile (pinned or detected, with ``profile_overrides``) and
    its behaviour from the decision table (``dfl_agent.profiles.behaviour``).

    With ``spec``, the behaviour also checks that an aggregator can hold the models of
    its participants (the model's trainable parameters; needs torch).

    Raises:
        ValueError: unknown profile, invalid override, the profile cannot run the
            algorithm, or an inference-only profile (it runs ``dfl-infer``, not the agent).
        LookupError: ``profile = "auto"`` and no profile matches this machine.
    """
    from dfl_agent.profiles import resolve_profile, select_behaviour

    profile, detection = resolve_profile(cfg.profile, cfg.profile_overrides)
    if detection is not None:
        log.info("detected device profile %s", profile.name)
    if profile.inference_only:
        raise ValueError(f"profile {profile.name!r} is inference-only: run 'dfl-infer run', not the training agent")
    params = None
    if spec is not None:  # from the spec where it tells (no torch), else from a meta-device model
        from dfl_agent.models import param_count

        params = param_count(spec)
    t = cfg.training
    return profile, select_behaviour(
        profile, algorithm, config_model_size=cfg.model.size, config_model_spec=bool(cfg.model.spec),
        config_threads=t.threads, config_batch_size=t.batch_size, config_device=t.device,
        model_params=params, participants=max(2, cfg.discovery.min_peers + 1),
    )


def choose_model_specs(algorithm: str, input_shape: Sequence[int], num_classes: int, nodes: int, *,
                       family: str | None = None, family_tier: str | None = None,
                       specs: Sequence[dict[str, Any]] | None = None, spec: dict[str, Any] | None = None,
                       tiers: Sequence[str | None] | None = None, size: str = "medium") -> list[dict[str, Any]]:
    """The model spec of each of ``nodes`` nodes: the one rule of the daemon and the simulator.

    In order, the first that applies:

    1. ``family`` (an architecture mode, e.g. ``H1``): with ``family_tier`` every node
       trains that tier's member (:func:`dfl_agent.models.families.family_member`: a
       device); without, the family's members are spread over the nodes in turn (the
       simulator's ``--models H2``);
    2. ``specs``: one spec per node, cycled;
    3. ``spec``: the same spec for every node;
    4. the algorithm's default model (:func:`algorithm_default_spec`)
       of each node's size tier (``tiers[i]``, a ``None`` entry meaning ``size``).  Where
       no node's tier is known (``tiers`` is None), the width-scaled algorithms
       (HeteroFL, FedRolex) spread DFML's H1 family over the nodes instead
       (:func:`simulator_default_specs`).

    Args:
        algorithm: registered algorithm name.
        input_shape: one sample's shape (e.g. ``(3, 128)``); num_classes: classes of the data.
        nodes: how many specs to return (>= 1).

    Returns:
        ``nodes`` validated specs (dicts; equal entries may be the same object).

    Raises:
        ValueError: an invalid spec, an unknown family or tier, or a family the data does not fit.
    """
    from dfl_agent.models import validate_spec

    if family:
        from dfl_agent.models.families import family_member, family_specs

        if family_tier is not None:
            return [family_member(family, input_shape, num_classes, family_tier)] * nodes
        fam = family_specs(family, input_shape, num_classes)
        return [fam[i % len(fam)] for i in range(nodes)]
    if specs:
        return [validate_spec(specs[i % len(specs)]) for i in range(nodes)]
    if spec:
        return [validate_spec(spec)] * nodes
    if tiers is None:
        return simulator_default_specs(algorithm, input_shape, num_classes, nodes, size)
    return [algorithm_default_spec(algorithm, input_shape, num_classes, tiers[i % len(tiers)] or size)
            for i in range(nodes)]


def algorithm_default_spec(algorithm: str, input_shape: Sequence[int], num_classes: int,
                           size: str = "medium") -> dict[str, Any]:
    """The default model spec of the registered ``algorithm`` (its trait ``default_model``,
    :func:`dfl_agent.models.defaults.default_model_spec`) for one node of tier ``size``.

    Raises:
        KeyError: unknown algorithm.  ValueError: unknown size tier.
    """
    from dfl_agent.algorithms.base import traits_of
    from dfl_agent.models.defaults import default_model_spec

    return default_model_spec(traits_of(algorithm).default_model, input_shape, num_classes, size)


def simulator_default_specs(algorithm: str, input_shape: Sequence[int], num_classes: int, nodes: int,
                            size: str = "medium") -> list[dict[str, Any]]:
    """One default spec per node of a simulation that chooses no model
    (:func:`dfl_agent.models.defaults.default_model_specs` of the algorithm's trait
    ``default_model``: H1 spread over the nodes for the width-scaled algorithms).

    Raises:
        KeyError: unknown algorithm.  ValueError: unknown size tier.
    """
    from dfl_agent.algorithms.base import traits_of
    from dfl_agent.models.defaults import default_model_specs

    return default_model_specs(traits_of(algorithm).default_model, input_shape, num_classes, nodes, size)


def check_algorithm_models(algorithm: str, specs: Sequence[Mapping[str, Any]]) -> None:
    """Check that the registered ``algorithm`` can train the models ``specs``
    (:func:`dfl_agent.models.defaults.check_models` with its trait ``default_model``).

    Raises:
        ValueError: one line naming the algorithm, the model and the fix.  KeyError:
            unknown algorithm.
    """
    from dfl_agent.algorithms.base import traits_of
    from dfl_agent.models.defaults import check_models

    check_models(traits_of(algorithm).default_model, algorithm, specs)


def model_spec_for(cfg: NodeConfig, algorithm: str, input_shape: Sequence[int], num_classes: int, *,
                   profile_size: str = "medium", tier: str | None = None) -> dict[str, Any]:
    """The model spec a device trains (:func:`choose_model_specs` for one node):
    ``model.spec``; else the member of ``model.family`` for the node's tier
    (``model.size``, else the profile's ``profile_size``); else the algorithm's default
    model of the decision table's ``tier`` (medium when None).

    Raises:
        ValueError: an invalid spec, an unknown family, or a family the data does not fit.
    """
    return choose_model_specs(algorithm, input_shape, num_classes, 1, family=cfg.model.family,
                              family_tier=cfg.model.size or profile_size, spec=cfg.model.spec,
                              tiers=[tier], size="medium")[0]


def check_node_model(algorithm: str, spec: dict[str, Any], num_classes: int) -> None:
    """The model ``spec`` suits ``algorithm`` and data of ``num_classes`` classes.

    Raises:
        ValueError: the algorithm cannot train the model (one line naming the fix), or
            the spec's class count differs from the data's.
    """
    check_algorithm_models(algorithm, [spec])
    if spec["num_classes"] != num_classes:
        raise ValueError(f"model.spec has {spec['num_classes']} classes, the data {num_classes}")


def choose_compression(policy: CompressionPolicy | None, behaviour: Behaviour | None, algorithm: str, *,
                       error_feedback: bool = True) -> CompressionPolicy | None:
    """The node's :class:`~dfl_agent.learning.compression.CompressionPolicy`: ``policy``
    (the node's or simulation's own) when it compresses anything, else the device
    profile's (:func:`dfl_agent.profiles.behaviour.profile_compression_policy`, None
    without a profile), else None.

    Raises:
        dfl_agent.learning.compression.CompressionError: the profile's spec is invalid.
    """
    if policy is not None and policy.active:
        return policy
    if behaviour is None:
        return None
    from dfl_agent.profiles.behaviour import profile_compression_policy

    return profile_compression_policy(behaviour, algorithm, error_feedback=error_feedback)


def link_settings(cfg: NodeConfig, options: Any, spec: dict[str, Any]) -> tuple[LinkTimings, Any, float]:
    """What ``mqtt.link_rate`` changes (the rule: :mod:`dfl_agent.transport.link_rate`): the
    :class:`~dfl_agent.transport.link_rate.LinkTimings` (chunk size, keepalive, ...), the
    algorithm options with every wait for models (:func:`~dfl_agent.transport.link_rate.model_waits`:
    ``round_timeout``, ``receive_timeout``, ...) widened by two model exchanges with every
    neighbour, each unless ``algorithm.options`` sets it, and the heartbeat timeout
    (``discovery.heartbeat_timeout``, raised to two such exchanges where that is longer).

    The model's bytes are its float32 parameters (the spec's, without torch where the
    spec tells); the neighbours are ``algorithm.neighbours``, else ``discovery.min_peers``.
    """
    import dataclasses

    from dfl_agent.models import param_count
    from dfl_agent.transport.link_rate import derive, model_waits

    m, disc = cfg.mqtt, cfg.discovery
    timings = derive(m.link_rate, chunk_size=m.chunk_size, keepalive=m.keepalive)
    if timings.rate_bps is None:
        return timings, options, disc.heartbeat_timeout
    model_bytes = 4 * param_count(spec)
    neighbours = len(cfg.algorithm.neighbours) if cfg.algorithm.neighbours else max(1, disc.min_peers)
    waits = {k: timings.round_timeout(v, model_bytes, neighbours)
             for k, v in model_waits(options).items() if k not in cfg.algorithm.options}
    options = dataclasses.replace(options, **waits) if waits else options
    heartbeat = timings.heartbeat_timeout(disc.heartbeat_timeout, model_bytes, neighbours)
    log.info("link rate %.0f bit/s: chunks of %d bytes (%.1f s each), keepalive %d s, %s, heartbeat timeout %.0f s",
             timings.rate_bps, timings.chunk_size, timings.chunk_seconds, timings.keepalive,
             ", ".join(f"{k} {v:.0f} s" for k, v in waits.items()) or "no model waits widened", heartbeat)
    return timings, options, heartbeat


def build_security(cfg: NodeConfig, state_dir: Path, node_id: str) -> SecurityGuard:
    """The node's :class:`dfl_agent.security.SecurityGuard` from ``[security]``.

    Loads (or creates, mode 0600) the node key, reads the device certificate
    (``security.certificate``, else ``state_dir/node_cert.json`` when present), and
    builds the trust store from ``security.trusted_keys`` and ``security.federation_key``
    (this node's own key is always trusted).

    Raises:
        StartupError: unreadable key or certificate, a certificate for another node.
    """
    from dfl_agent.security import SecurityError, SecurityGuard, SeqCounter, TrustStore
    from dfl_agent.security.keys import (
        CERT_FILE,
        CertificateExpired,
        CertificateNotYetValid,
        load_certificate,
        load_or_create_key,
        parse_public_key,
        public_key_b64,
    )
    from dfl_agent.security.revocation import REVOCATIONS_FILE, Revocations
    from dfl_agent.security.trust import SEQ_FILE, KeyRevoked

    sec = cfg.security
    try:
        key = load_or_create_key(state_dir, sec.key_file)
        pinned = {k: str(v) for k, v in sec.trusted_keys.items()}
        pinned.setdefault(node_id, public_key_b64(key))
        # the newest revocation list this node verified (its supervisor keeps it up to date)
        revocations = Revocations(cfg.federation, parse_public_key(sec.federation_key) if sec.federation_key else None,
                                  state_dir / REVOCATIONS_FILE)
        trust = TrustStore(cfg.federation, pinned, sec.federation_key,
                           operators={k: str(v) for k, v in getattr(sec, "operators", {}).items()},
                           revocations=revocations)
        cert_path = sec.certificate or (state_dir / CERT_FILE if (state_dir / CERT_FILE).exists() else None)
        cert = load_certificate(cert_path) if cert_path else None
        if cert is not None and trust.federation_key is not None:
            if cert.get("node_id") != node_id:
                raise SecurityError(f"certificate {cert_path} is for node {cert.get('node_id')!r}, not {node_id!r}")
            try:
                trust.add_certificate(cert)
            except CertificateExpired as exc:
                raise SecurityError(f"{exc} (renew it: dflctl keys renew {node_id})") from None
            except CertificateNotYetValid as exc:  # no real-time clock: NTP may still set it
                log.warning("%s; peers may refuse this node's messages until it is set", exc)
            except KeyRevoked as exc:
                log.error("this node's own certificate is refused: %s; its peers ignore it", exc)
            warn_expiry(cert)
    except SecurityError as exc:
        raise StartupError(f"security: {exc}") from None
    log.info("node key %s (public %s); signatures %s", sec.key_file or state_dir / "node_key.pem",
             public_key_b64(key), "required" if sec.require_signatures else "optional")
    return SecurityGuard(node_id, key, trust, require_signatures=sec.require_signatures, certificate=cert,
                         replay_window=sec.replay_window, seq=SeqCounter(state_dir / SEQ_FILE))


def warn_expiry(cert: Mapping[str, object] | None, now: float | None = None) -> str | None:
    """Log (WARNING) and return the line saying that this node's certificate ``cert`` expires
    within :data:`~dfl_agent.security.keys.EXPIRY_WARNING_DAYS` days, or None."""
    import time as _time

    from dfl_agent.security.keys import EXPIRY_WARNING_DAYS, utc_date

    if not isinstance(cert, dict):
        return None
    exp = cert.get("expires")
    if not isinstance(exp, (int, float)) or isinstance(exp, bool):
        return None
    left = (exp - (_time.time() if now is None else now)) / 86400.0
    if left > EXPIRY_WARNING_DAYS or left < 0:
        return None
    node = cert.get("node_id")
    line = (f"the certificate of node {node} expires on {utc_date(exp)} (in {left:.0f} days): "
            f"renew it with dflctl keys renew {node}")
    log.warning("%s", line)
    return line
