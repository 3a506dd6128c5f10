"""The daemon's configuration: a TOML file validated once into typed dataclasses.

Every key carries its description as field metadata (:func:`described`); the
configuration reference is generated from them (``dfl_agent.cli.gen_reference``).
An unknown key, a value of the wrong type or out of range stops start-up with a :class:`ConfigError`
naming the key (``mqtt.chunk_size: must be >= 1024``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.learning.training import DEFAULT_ADAM_LR, DEFAULT_DIVERGENCE_FACTOR, DEFAULT_LR
from dfl_agent.privacy.config import PrivacySection, section_table
from dfl_agent.tomlcheck import TOMLDecodeError, TomlFileError, build, read_toml

if TYPE_CHECKING:
    from dfl_agent.learning.compression import CompressionPolicy


class ConfigError(ValueError):
    """Invalid configuration; the message starts with the offending key."""


def described(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
              default_text: str | None = None) -> Any:
    """A configuration field with its description (``metadata["help"]``).

    Every field of every section carries one; ``tests/unit/test_reference.py`` fails
    otherwise, and ``dfl_agent.cli.gen_reference`` writes the configuration reference
    from them.  ``default_text`` replaces the shown default where the literal default
    is a placeholder (e.g. ``None`` meaning "from the device profile").
    """
    meta: dict[str, Any] = {"help": help} if default_text is None else {"help": help, "default_text": default_text}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@dataclasses.dataclass
class AlgorithmSection:
    """``[algorithm]``: which algorithm this node runs and for how long (the node's default run)."""

    name: str = described("fedavg", help="the algorithm; `dflctl algorithms` lists them")
    rounds: int = described(20, help="rounds to run")
    options: dict[str, Any] = described(default_factory=dict,
        help="the algorithm's options (see the algorithm's page); an unknown option stops start-up")
    neighbours: list[str] | None = described(
        None, help="this node's neighbours in the communication graph (node ids); unset: every discovered peer",
        default_text="every peer")
    every: str | None = described(
        None, help="recurrence of the default run, a duration such as `\"6h\"`; unset: the run happens once",
        default_text="once")
    every_samples: int | None = described(
        None, help="start the default run again once the sample store (`data.dataset = \"store\"`) holds at "
                   "least this many samples that the last run's snapshot did not have; never overlaps itself",
        default_text="off")


@dataclasses.dataclass
class TrainingSection:
    """``[training]``: local SGD and compute placement.

    ``batch_size``, ``device`` and ``threads`` left unset (None) come from the device
    profile (``dfl_agent.profiles``); set here they override it."""

    epochs: int = described(1, help="local epochs per round")
    steps: int = described(0, help="when > 0, exactly this many mini-batch steps per round instead of `epochs` passes "
                                   "(1: one SGD step per gossip round, CHOCO-SGD's setting, where sparsified gossip works)")
    batch_size: int | None = described(None, help="mini-batch size", default_text="from the profile (32)")
    lr: float | None = described(
        None, help="SGD learning rate (a fresh optimizer every round); set, it is also the Adam rate of "
                   "`fedd2s`, `fedper` and `local_adam` unless their `adam_lr` option is given",
        default_text=f"`{DEFAULT_LR}` (Adam algorithms: `{DEFAULT_ADAM_LR}`)")
    momentum: float = described(0.9, help="SGD momentum, in [0, 1)")
    weight_decay: float = described(0.0, help="SGD weight decay")
    warm_start_ramp: int = described(5, help="rounds a warm-started run ramps its learning rates up from a tenth (0: off)")
    warm_start_probe: bool = described(True, help="a warm-started run first fits the output layer to the store (linear probe)")
    clip_grad_norm: float = described(0.0, help="clip each SGD step of local training to this gradient L2 norm (0: off; "
                                      "not DFML's mutual learning, Def-KT's transfer or the Adam algorithms)")
    divergence_factor: float = described(
        DEFAULT_DIVERGENCE_FACTOR, help="undo a round of local SGD whose batch loss exceeds this multiple of "
        "max(its first batch's, ln K), counted as diverged (0: only a non-finite loss or model)")
    device: str | None = described(None, help="`cpu`, `auto` or `cuda[:N]`", default_text="from the profile (`cpu`)")
    threads: int | None = described(None, help="torch intra-op threads", default_text="from the profile (1)")


@dataclasses.dataclass
class DataSection:
    """``[data]``: where this node's data comes from."""

    dataset: str = described("har", help="`har`, `digits`, `idx` (MNIST-format files in `data.path`), `npz`")
    path: str | None = described(None, help="directory for `idx` / `npz`")
    partition: str = described("by-user", help="`iid`, `dirichlet` (`data.beta`), `shards` (`data.zeta`), `by-user`")
    num_nodes: int = described(1, help="number of shares the data set is partitioned into")
    node_index: int = described(0, help="this node's share, in [0, `data.num_nodes`)")
    beta: float = described(0.5, help="Dirichlet concentration of the `dirichlet` partition (label skew)")
    zeta: int = described(2, help="classes (shards) per node of the `shards` partition")
    cache_dir: str | None = described(None, help="where the converted HAR `.npz` is cached",
                                            default_text="`$DFL_CACHE_DIR` or `~/.cache/dfl-agent`")
    # -- the on-device sample store (dataset = "store"; dfl_agent.store)
    input_shape: list[int] | None = described(
        None, help="store: one sample's shape", default_text="from `meta.json` in `data.path`")
    num_classes: int | None = described(None, help="store: number of classes", default_text="from `meta.json`")
    class_names: list[str] | None = described(None, help="store: class names, in label order",
                                              default_text="from `meta.json`")
    spool_dir: str | None = described(None, help="store: folder the agent ingests sample files from",
                                      default_text="`state_dir/spool`")
    spool_interval: float = described(5.0, help="store: seconds between spool passes while the agent runs")
    store_max_samples: int = described(100_000, help="store: most samples kept")
    store_max_age: str | None = described("30d", help="store: samples older than this are evicted (`\"30d\"`, "
                                                      "`\"12h\"`, ... or `\"none\"`)")
    store_max_per_class: int = described(0, help="store: most samples kept per class (0 = no per-class cap)")
    store_eviction: str = described("oldest", help="store: which samples go first, `oldest` or `largest-class`")
    store_max_ingest_bytes: int = described(
        256 * 1024 * 1024, help="store: most bytes the arrays of one spool file may take once decompressed (read "
                                "from the archive's headers before loading; a larger file is rejected)")
    validation_share: float = described(0.2, help="store: share of samples held out for validation, "
                                                  "chosen by a hash of the sample id")


#: names of :data:`dfl_agent.models.families.FAMILIES` (kept here: the config stays torch-free)
MODEL_FAMILIES = ("H0", "H1", "H1-resnet", "H2")


@dataclasses.dataclass
class ModelSection:
    """``[model]``: a size tier of the dataset's default model, or an explicit spec
    (``size`` unset: from the device profile and the decision table)."""

    size: str | None = described(None, help="`small`, `medium`, `large`: the dataset's default model, scaled",
                                 default_text="from the decision table")
    spec: dict[str, Any] | None = described(
        None, help="an explicit model spec, e.g. `{type = \"cnn1d\", in_channels = 3, length = 128, "
                   "channels = [16, 32, 64], kernel = 5, num_classes = 6, norm = \"layer\"}`; "
                   "DFML federations mix different specs")
    family: str | None = described(
        None, help="a model family (`H0`, `H1`, `H1-resnet`, `H2`): the node trains the family member of its "
                   "size tier (`large` the widest, `medium` the second, `small` the third); "
                   "`dflctl run submit --models` sets it for one run",
        default_text="none: the algorithm's default model")


@dataclasses.dataclass
class MqttSection:
    """``[mqtt]``: the home broker and message limits."""

    broker: str = described("127.0.0.1:1883", help="home broker `host:port` (IPv6: `[addr]:port`)")
    protocol: str = described("5", help="MQTT protocol version, `5` or `3.1.1`")
    chunk_size: int | None = described(None, help="largest MQTT payload sent (bytes); larger frames are chunked",
                                       default_text="262144 (256 KiB); less with a slow `link_rate`")
    max_frame_bytes: int = described(64 * 1024 * 1024, help="larger incoming messages are dropped unread (bytes)")
    keepalive: int | None = described(None, help="MQTT keepalive (s); the broker fires the last will after about "
                                      "1.5× this", default_text="10; more with a slow `link_rate`")
    link_rate: str = described("", help="the device's slowest link in bits/s, e.g. `0.5mbit`, `256kbit`: chunk size, "
                               "keepalive and round deadlines follow it (how-to: slow links); empty: a fast network")
    heartbeat_interval: float = described(5.0, help="status republish period (s)")
    username: str | None = described(None, help="broker user name")
    password: str | None = described(None, help="broker password")
    bridged: bool = described(False, help="reach every peer through the home broker (site brokers bridged)")
    tls_ca: str | None = described(None, help="CA certificate file: MQTT over TLS, the broker verified against it")
    tls_cert: str | None = described(None, help="client certificate file (needs `mqtt.tls_ca` and `mqtt.tls_key`)")
    tls_key: str | None = described(None, help="client certificate's private key file")
    max_transfers: int = described(64, help="incomplete chunked transfers held per broker connection")


@dataclasses.dataclass
class DiscoverySection:
    """``[discovery]``: how peers are found and when the first round starts."""

    mdns: bool = described(True, help="advertise and browse `_dfl._tcp.local.`")
    interfaces: list[str] = described(default_factory=lambda: ["127.0.0.1"],
                                      help="interface addresses for mDNS (required when mdns is on)")
    static_peers: list[Any] = described(
        default_factory=list, help="`\"id\"`, `\"id@host:port\"` (its broker) or `{id = .., broker = ..}`")
    min_peers: int = described(0, help="peers to wait for before round 1")
    start_timeout: float = described(60.0, help="longest wait for `min_peers` (s); then it starts anyway")
    heartbeat_timeout: float = described(30.0, help="a peer not heard from for this long (s) is not waited for")


@dataclasses.dataclass
class RuntimeSection:
    """``[runtime]``: reporting, checkpoints, logging and baselines."""

    baseline_local: bool = described(False, help="also train a local-only copy and report its accuracy")
    eval_every: int = described(1, help="evaluate the deployable model every this many rounds (and the last)")
    eval_background: bool = described(
        True, help="evaluate a copy of the models (and train the local-only baseline) while the next round runs, "
        "so that evaluation never delays the federation; `false`: between rounds")
    metrics_file: str | None = described(None, help="per-round metrics (JSON lines)", default_text="`state_dir/metrics.jsonl`")
    log_level: str = described("info", help="`debug`, `info`, `warning`, `error`")
    init: str = described("common", help="`common`: every node starts from the same (seeded) weights; `independent`")
    checkpoint: bool = described(True, help="write a checkpoint after every round and resume from it at start")
    checkpoint_keep: int = described(2, help="checkpoints kept (≥ 2 keeps a fallback)")
    log_format: str = described("auto", help="`auto` (journal priorities under journald), `text`, `journal`")
    prometheus_port: int = described(0, help="Prometheus `/metrics` port (0 = off; needs the `metrics` extra)")
    prometheus_address: str = described("127.0.0.1", help="address the Prometheus endpoint binds")
    rejoin: bool = described(True, help="deprecated and always on: a restarted node rejoins its run at its round")
    pause_when_disconnected: bool = described(True, help="while the broker is away: no training, no round "
                                              "closes (its deadline suspended); state `paused`")
    max_catch_up_rounds: int = described(10, help="most rounds one catch-up skips at once (at a restart or "
                                         "during a run); a node further behind skips again; 0 = never skip")
    allow_alone: bool = described(False, help="`run --once` exits 0, not 4, after a run degraded for more than half "
                                  "its rounds (closed with no peer update)")
    run_retries: int = described(2, help="times a run process that crashed or was killed is started again from "
                                         "the run's last checkpoint before the run fails (an OOM kill: at most once)")
    run_stop_grace: float = described(30.0, help="seconds a run process has to stop after SIGTERM before SIGKILL")
    run_init: str = described("deployed", help="`deployed`: a run starts from the deployed model when its "
                              "architecture matches (else fresh, logged why); `fresh`; `run submit --init` overrides")
    keep_runs: int = described(20, help="ended runs whose folders (round records gzipped, how each ended) are "
                               "kept, newest first; an older run keeps a one-line summary in the run ledger")
    keep_run_files: bool = described(False, help="keep an ended run's checkpoints, `run.toml` and plain round "
                                     "records as the run left them (measurements on them: the field lab); `false`: "
                                     "deleted, and the round records gzipped, once the run ledger records the run ended")
    disk_warn_mb: int = described(1024, help="the agent's log (at start and after each run) and `dflctl doctor` warn "
                                  "when the disk under `state_dir` has less free space than this (MiB); 0 = never")
    straggler: str = described("quorum", help="`quorum`: rounds close without the slowest neighbours, adaptive "
                               "deadlines, late updates weighted; `paper`: lock step (how-to: choose an algorithm)")
    min_round_timeout: float = described(2.0, help="quorum: the adaptive round deadline's lower bound (s)")
    max_round_timeout: float = described(120.0, help="quorum: its upper bound (s) where the algorithm has no "
                                         "`round_timeout` (the rotating family: also at most `invite_timeout`)")


@dataclasses.dataclass
class CompressionSection:
    """``[compression]``: compression of this node's messages (grammar in
    :mod:`dfl_agent.learning.compression`).

    ``spec`` applies to every kind (averaging gossip compresses CHOCO differences with
    it; whole-model exchanges use only its value and entropy coders); ``kinds`` maps a
    message kind to a spec applied exactly as written (e.g. ``{"gt.sync" =
    "topk:0.01+q8"}``).  ``error_feedback`` keeps residuals / CHOCO copies for
    sparsified streams; ``consensus_step`` is CHOCO's γ (0 = automatic) and
    ``keyframe_every`` how often a gossip stream resends its full copy (0 = automatic:
    first message only for dense specs, every 100 messages for sparsified ones; < 0 = first only).
    """

    spec: str = described(
        "auto", help="compression spec for every message kind, e.g. `none`, `q8`, `topk:0.01+q8` (gossip: "
                     "CHOCO differences; whole-model exchanges: only its value and entropy coders); `auto`: "
                     "`q4+zstd` for averaging gossip, every other message as float32 (measured: the "
                     "compression how-to)")
    kinds: dict[str, str] = described(default_factory=dict,
        help="per message kind, a spec applied exactly as written, e.g. `{ \"gt.sync\" = \"topk:0.1+q8\" }`")
    error_feedback: bool = described(True, help="keep residuals / CHOCO copies for sparsified streams")
    consensus_step: float = described(0.0, help="CHOCO's consensus step γ (0 = automatic)")
    keyframe_every: int = described(
        0, help="gossip keyframe period in messages (0 = automatic: dense specs first message only, "
                "sparsified every 100; < 0 = first message only)")

    def policy(self) -> CompressionPolicy | None:
        """The :class:`~dfl_agent.learning.compression.CompressionPolicy` (None when off)."""
        from dfl_agent.learning.compression import CompressionPolicy

        p = CompressionPolicy.from_config(self.spec, self.kinds, error_feedback=self.error_feedback,
                                          consensus_step=self.consensus_step, keyframe_every=self.keyframe_every)
        return p if p.active else None


@dataclasses.dataclass
class SecuritySection:
    """``[security]``: node key, federation trust and replay protection."""

    require_signatures: bool = described(False, help="reject unsigned messages and unknown senders (trusted keys)")
    key_file: str | None = described(None, help="the node's Ed25519 key (created if missing)",
                                           default_text="`state_dir/node_key.pem`")
    certificate: str | None = described(None, help="this node's device certificate",
                                              default_text="`state_dir/node_cert.json` if present")
    federation_key: str | None = described(None, help="base64 public key that signs device certificates")
    trusted_keys: dict[str, Any] = described(default_factory=dict,
                                             help="pinned keys, `node_id = \"<base64 public key>\"`")
    operators: dict[str, Any] = described(default_factory=dict,
                                          help="operator keys, `name = \"<base64 public key>\"`: may submit and cancel runs, never train")
    replay_window: float = described(300.0, help="largest accepted age, or clock skew, of a message (s)")
    max_queued_per_sender: int = described(16, help="buffered messages per sender")


@dataclasses.dataclass
class DeploySection:
    """``[deploy]``: model delivery to the device's application (``state_dir/models``)."""

    enabled: bool = described(True, help="deploy after each run (only with `data.dataset = \"store\"`)")
    tolerance: float = described(
        0.01, help="a candidate worse than the deployed model by more than this (accuracy) is not deployed")
    keep: int = described(3, help="model versions kept under `state_dir/models`")
    min_validation: int = described(
        20, help="with fewer validation samples, deploy only with `--force` or when no model is deployed")
    onnx: bool = described(
        True, help="export `model.onnx` (checked against torch) when the onnx extra is installed; "
                   "false: `model.safetensors` and `spec.json` only, no inference-member delivery")


@dataclasses.dataclass
class NodeConfig:
    """The whole node configuration (top-level keys + sections)."""

    federation: str = described(
        "default", help="federation id (`[A-Za-z0-9_.-]{1,64}`); messages of other federations are dropped")
    node_id: str | None = described(
        None, help="fixed node id; otherwise taken from (or created in) `state_dir/node_id`")
    state_dir: str = described("/var/lib/dfl-agent", help="the node's persistent state: node id, keys, "
                                                          "checkpoints, metrics")
    seed: int = described(0, help="seeds the partition, the initial weights (see `runtime.init`) and every random choice")
    profile: str = described("generic-x86", help="device profile, or `auto` to detect it (`dflctl profile list`)")
    profile_overrides: dict[str, Any] = described(
        default_factory=dict,
        help="single profile fields, e.g. `{ limits = { min_battery_percent = 50 } }`")
    algorithm: AlgorithmSection = described(default_factory=AlgorithmSection, help="`[algorithm]` section")
    training: TrainingSection = described(default_factory=TrainingSection, help="`[training]` section")
    data: DataSection = described(default_factory=DataSection, help="`[data]` section")
    model: ModelSection = described(default_factory=ModelSection, help="`[model]` section")
    mqtt: MqttSection = described(default_factory=MqttSection, help="`[mqtt]` section")
    discovery: DiscoverySection = described(default_factory=DiscoverySection, help="`[discovery]` section")
    runtime: RuntimeSection = described(default_factory=RuntimeSection, help="`[runtime]` section")
    compression: CompressionSection = described(default_factory=CompressionSection, help="`[compression]` section")
    security: SecuritySection = described(default_factory=SecuritySection, help="`[security]` section")
    deploy: DeploySection = described(default_factory=DeploySection, help="`[deploy]` section")
    privacy: PrivacySection = described(default_factory=PrivacySection, help="`[privacy]` section")

    @property
    def deploys(self) -> bool:
        """Whether a run deploys its model (``deploy.enabled`` and the sample store): then
        inference members get the deployed version, else the run's live model."""
        return self.deploy.enabled and self.data.dataset == "store"


def _from_dict(cls: type, raw: Mapping[str, Any], prefix: str = "") -> Any:
    return build(cls, raw, prefix, error=ConfigError, sort_known=True)


def config_from_dict(raw: Mapping[str, Any]) -> NodeConfig:
    """Validate a parsed configuration table.

    Raises:
        ConfigError: naming the first offending key.
    """
    try:
        cfg = _from_dict(NodeConfig, raw)
    except TypeError as exc:  # pragma: no cover - defensive
        raise ConfigError(str(exc)) from None
    from dfl_agent.runtime.shared.config_checks import validate

    validate(cfg)
    #: whether the file has an [algorithm] section: the node's default run (runs.py)
    cfg.has_default_run = "algorithm" in raw
    if cfg.runtime.rejoin is False:
        import logging

        logging.getLogger("dfl_agent.config").warning(
            "runtime.rejoin is deprecated and always on: a restarted node rejoins its run at the federation's round")
        cfg.runtime.rejoin = True
    return cfg


def load_config(path: str | os.PathLike[str]) -> NodeConfig:
    """Read and validate a TOML configuration file.

    Raises:
        ConfigError: unreadable file, TOML syntax error, not UTF-8 or nested too deeply
            (:func:`~dfl_agent.tomlcheck.read_toml`), or an invalid key (named).
    """
    p = Path(path)
    try:
        raw = read_toml(p)  # bounded in size and nesting; a byte that is not UTF-8 named by its key
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    except TOMLDecodeError as exc:
        raise ConfigError(f"{p}: TOML syntax error: {exc}") from None
    except TomlFileError as exc:
        raise ConfigError(str(exc)) from None
    return config_from_dict(raw)


def dump_toml(cfg: NodeConfig) -> str:
    """Serialise ``cfg`` to TOML with ``tomli_w`` (strings escaped as TOML requires, control
    characters included).

    Unset (None) keys and empty tables are left out (both are the defaults); every section is
    written, so the text parses back (:func:`config_from_dict`) to an equal configuration.
    """
    import tomli_w

    def keep(v: object) -> bool:
        return v is not None and not (isinstance(v, dict) and not v)

    doc: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            doc[f.name] = {k: x for k, x in section_table(v).items() if keep(x)}  # nested tables too
        elif keep(v):
            doc[f.name] = v
    return tomli_w.dumps(doc)
