"""The simulator: N nodes of one algorithm in one process, one seed, a metrics folder.

Nodes talk over :class:`~dfl_agent.transport.memory.MemoryNetwork` (the same wire frames
as MQTT) on a :class:`~dfl_agent.transport.memory.VirtualTimeLoop`, so round deadlines
cost no real time and a run is a pure function of (config, seed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dfl_agent.algorithms.base import check_dp_combination, dp_steps_per_round, get_algorithm, parse_options, traits_of
from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy, quorum_options
from dfl_agent.algorithms.topology import build_topology
from dfl_agent.data import load_dataset, make_node_data, partition
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.compression import CompressionPolicy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import spec_hash
from dfl_agent.runtime.node import metrics
from dfl_agent.runtime.node.batching import BatchTrainer
from dfl_agent.runtime.node.build import build_node
from dfl_agent.runtime.node.node import Node, init_seed_for
from dfl_agent.runtime.node.node_hooks import NodeKilled
from dfl_agent.runtime.shared.assembly import check_algorithm_models, choose_compression, choose_model_specs
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from dfl_agent.transport.versions import SPOKEN

if TYPE_CHECKING:
    from dfl_agent.data import NodeData
    from dfl_agent.privacy.config import DPConfig
    from dfl_agent.profiles.behaviour import Behaviour

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SimConfig:
    """One simulation run.

    Attributes:
        algorithm: registered algorithm name.
        nodes: number of nodes N.
        rounds: rounds R.
        dataset: ``har``, ``digits``, ``idx`` or ``npz`` (the last two need ``dataset_path``).
        partition: ``iid``, ``dirichlet`` (``beta``), ``shards`` (``zeta``) or ``by-user``.
        seed: derives partition, initialisation, batch order and every random choice.
        out: report folder (``metrics.jsonl``, ``summary.json``, ``accuracy.png``); None = no files.
        options: the algorithm's options table.
        init: ``common`` (every node starts from the same weights) or ``independent``.
        latency: one-way message delay in virtual seconds.
        kill: ``{node_index: round}``: crash that node when it starts that round (fault injection).
        baseline_local: also train and report a local-only copy per node.
        model_specs: one model spec per node (heterogeneous federations); a shorter
            list is cycled; ``None`` = every node gets ``model_spec`` / the default.
        eval_every: evaluate the nodes every this many rounds (always the first and last).
        threads: torch intra-op threads for the whole run (1 avoids oversubscription
            when other processes share the cores; restored afterwards).
        model_family: an architecture mode of DFML's Table 10 (``H0``, ``H1``, ``H2``),
            spread evenly over the nodes (overrides ``model_specs``).
        topology: communication graph name (see ``dfl_agent.algorithms.topology``) and its
            ``topology_options``; ``full`` = everyone is a neighbour.
        profiles: device profile names, one per node (cycled): each node's model size
            tier (for algorithms that mix architectures, unless ``model_family`` /
            ``model_specs`` / ``model_spec`` is given), roles (a node without the
            aggregator role never leads a rotating round) and compression come from the
            decision table (``dfl_agent.profiles.behaviour``); every node still computes on
            ``device`` with ``train``.
        compression: compression spec of every node (``none``, ``fp16``, ``q8``,
            ``topk:0.01+q8``, ... see :mod:`dfl_agent.learning.compression`), with
            ``compression_kinds`` per message kind, ``error_feedback`` (residuals /
            CHOCO copies; off only to compare) and CHOCO's ``consensus_step`` γ
            (0 = automatic) and ``keyframe_every``.
        samples_per_node: when > 0, every node gets this many distinct pool samples,
            drawn for each node independently of the others (with replacement across
            nodes: a sample may go to several nodes), instead of ``partition``; for
            growth figures with more nodes than the pool has samples per node.
        batch: train the nodes that share architecture, optimizer settings and step
            count in the same virtual instant together, in one vectorised step, and
            evaluate the nodes that share an architecture in the same instant together
            (:mod:`dfl_agent.runtime.node.batching`); False: every node trains and is
            evaluated on its own.
        device: torch device every node's models live and train on: ``cpu`` (the
            default) or ``cuda`` / ``cuda:N``; a CUDA device that torch cannot see is a
            ``ValueError`` when the run starts (no silent fallback to cpu).
        straggler: ``paper`` (default: the papers' lock step, so that their figures
            reproduce) or ``quorum`` (the always-on agent's default:
            :mod:`dfl_agent.algorithms.protocols.stragglers`), with ``min_round_timeout``
            and ``max_round_timeout`` (virtual seconds).
        speeds: per-node speed factors (cycled), e.g. ``[1, 1, 1, 0.05]``: each training
            call of a node takes ``train_seconds / speed`` virtual seconds; None: training
            takes no virtual time.
        dp_epsilon: differential privacy (``dflctl simulate --dp-epsilon``): every node's
            training is DP-SGD whose whole run spends at most this ε at ``dp_delta``
            (its own plan: :func:`dfl_agent.privacy.plan.plan_run` on its sample count),
            each sample's gradient clipped to ``dp_max_grad_norm``; None: no DP.  Batched
            training then falls back to the per-node loop.
    """

    algorithm: str = "fedavg"
    nodes: int = 10
    rounds: int = 20
    dataset: str = "har"
    dataset_path: str | None = None
    partition: str = "by-user"
    beta: float = 0.5
    zeta: int = 2
    seed: int = 0
    out: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    model_size: str = "medium"
    model_spec: dict[str, Any] | None = None
    init: str = "common"
    latency: float = 0.0
    kill: dict[int, int] = dataclasses.field(default_factory=dict)
    baseline_local: bool = False
    cache_dir: str | None = None
    model_specs: list[dict[str, Any]] | None = None
    model_family: str | None = None
    threads: int = 1
    eval_every: int = 1
    topology: str = "full"
    topology_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    profiles: list[str] | None = None
    compression: str = "none"
    compression_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    error_feedback: bool = True
    consensus_step: float = 0.0
    keyframe_every: int = 0
    samples_per_node: int = 0
    batch: bool = True
    device: str = "cpu"
    straggler: str = "paper"
    min_round_timeout: float = 2.0
    max_round_timeout: float = 120.0
    speeds: list[float] | None = None
    train_seconds: float = 1.0
    dp_epsilon: float | None = None
    dp_max_grad_norm: float = 1.0
    dp_delta: float = 1e-5

    def __post_init__(self) -> None:
        self.policy()  # ValueError for a bad straggler setting
        if self.speeds is not None and (not self.speeds or not all(v > 0 for v in self.speeds)):
            raise ValueError(f"speeds must be positive factors, got {self.speeds}")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.samples_per_node < 0:
            raise ValueError(f"samples_per_node must be >= 0, got {self.samples_per_node}")
        if self.init not in ("common", "independent"):
            raise ValueError(f"init must be 'common' or 'independent', got {self.init!r}")
        if self.dp_epsilon is not None:
            self.privacy()  # ValueError naming the bad setting, Opacus missing, an algorithm refused
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", str(self.device))):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def privacy(self) -> DPConfig | None:
        """The :class:`~dfl_agent.privacy.config.DPConfig` of ``dp_*`` (None: no DP).

        Raises:
            ValueError: a bad setting or an algorithm that cannot run under DP (one line).
            ModuleNotFoundError: Opacus is not installed (naming the ``privacy`` extra).
        """
        if self.dp_epsilon is None:
            return None
        from dfl_agent.learning.dp import require_opacus
        from dfl_agent.privacy.config import parse_privacy

        dp = parse_privacy({"dp": {"target_epsilon": self.dp_epsilon, "max_grad_norm": self.dp_max_grad_norm,
                                   "delta": self.dp_delta}}).dp
        check_dp_combination(self.algorithm, self.options)
        if self.baseline_local:
            raise ValueError("privacy.dp: baseline_local cannot run under DP (its local-only copy would train "
                             "on the same data outside the run's privacy plan)")
        require_opacus()
        return dp

    def policy(self) -> StragglerPolicy:
        """The :class:`~dfl_agent.algorithms.protocols.stragglers.StragglerPolicy` of the run."""
        return StragglerPolicy(self.straggler, self.min_round_timeout, self.max_round_timeout)


def check_device(device: str, cuda: Any = None) -> str:
    """The torch device string ``device`` (``cpu``, ``cuda``, ``cuda:N``) resolves to on
    this machine: ``cuda`` becomes ``cuda:0``.

    Args:
        device: the requested device.
        cuda: ``torch.cuda`` or a stand-in with ``is_available`` and ``device_count``.

    Raises:
        ValueError: a CUDA device that torch does not see (no CUDA build, no GPU, or an
            index past ``device_count()``); the message says which.
    """
    if device == "cpu":
        return "cpu"
    if cuda is None:
        import torch

        cuda = torch.cuda
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    n = int(cuda.device_count()) if cuda.is_available() else 0
    if index >= n:
        raise ValueError(f"device {device} requested but torch sees {n} CUDA device(s) "
                         f"(torch.cuda.is_available() is {bool(cuda.is_available())}): use --device cpu")
    return f"cuda:{index}"


def node_name(i: int) -> str:
    """Canonical simulator node id for index ``i``."""
    return f"node{i:02d}"


def simulate(cfg: SimConfig, progress: Callable[[int, float | None], None] | None = None) -> dict[str, Any]:
    """Run the simulation; returns the ``summary.json`` document (also written to ``cfg.out``).

    ``progress(t, accuracy)``, when given, is called with ``t = 0`` when the rounds start,
    then once per round ``t`` (in order) when every node still running has finished it; ``accuracy`` is the mean global test
    accuracy of the nodes evaluated that round (None when none was).  The progress display
    of ``dflctl simulate`` and the benchmarks is ``dfl_agent.cli.progress``.

    Raises:
        KeyError: unknown algorithm. ValueError: bad option, dataset or partition arguments.
    """
    started = time.time()
    device = check_device(cfg.device)
    records: list[dict[str, Any]] = []
    sink = records.append if progress is None else _progress_sink(cfg, records, progress)
    fed = _assemble(cfg, device, sink)
    _run(cfg, fed, device, progress)
    summary = _summary(cfg, fed, device, wall=time.time() - started)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        metrics.write_jsonl(out / "metrics.jsonl", records)
        metrics.atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=float) + "\n")
        histories = {n.ctx.node_id: n.history for n in fed.nodes}
        metrics.plot_accuracy(histories, out / "accuracy.png", title=f"{cfg.algorithm} on {cfg.dataset}, {cfg.nodes} nodes")
    return summary


def round_records(cfg: SimConfig, prepare: Callable[[_Federation], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run ``cfg`` and return every node's round records (what a daemon writes to
    ``metrics.jsonl``) by node id, in round order.  ``prepare(federation)``, when given,
    runs once the nodes are built and before round 1; ``federation.nodes[i].algorithm`` is
    node i's algorithm, for studies that change one node (e.g. its training in one round).

    Raises:
        as :func:`simulate`.
    """
    device = check_device(cfg.device)
    records: list[dict[str, Any]] = []
    fed = _assemble(cfg, device, records.append)
    if prepare is not None:
        prepare(fed)
    _run(cfg, fed, device, None)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: r["round"]):
        by_node.setdefault(r["node"], []).append(r)
    return by_node


@dataclasses.dataclass
class _Federation:
    """The simulated federation, assembled: its nodes and what the summary reports."""

    nodes: list[Node]
    ids: list[str]
    spec: dict[str, Any]  # the configured single spec (summary.json's "model_spec", even when unused)
    specs: list[dict[str, Any]]
    behaviours: list[Behaviour] | None
    policy: CompressionPolicy
    batcher: BatchTrainer | None


def _assemble(cfg: SimConfig, device: str, sink: Callable[[dict[str, Any]], None]) -> _Federation:
    """Load the data, choose each node's model (:func:`~dfl_agent.runtime.shared.assembly.choose_model_specs`)
    and build the nodes (:func:`~dfl_agent.runtime.shared.assembly.build_node`) over one memory network."""
    algo_cls = get_algorithm(cfg.algorithm)
    straggler = cfg.policy()
    options = quorum_options(parse_options(algo_cls, cfg.options), straggler, cfg.options)
    bundle = load_dataset(cfg.dataset, path=cfg.dataset_path, cache_dir=cfg.cache_dir)
    if cfg.samples_per_node:
        parts = sampled_parts(len(bundle.pool), cfg.nodes, cfg.samples_per_node, cfg.seed)
    else:
        parts = partition(bundle.pool, cfg.nodes, cfg.partition, seed=cfg.seed, beta=cfg.beta, zeta=cfg.zeta)
    shape, n_classes = bundle.pool.input_shape, bundle.pool.num_classes
    spec = choose_model_specs(cfg.algorithm, shape, n_classes, 1, spec=cfg.model_spec, tiers=[cfg.model_size])[0]
    behaviours = _profile_behaviours(cfg)
    specs = choose_model_specs(cfg.algorithm, shape, n_classes, cfg.nodes, family=cfg.model_family,
                               specs=cfg.model_specs, spec=cfg.model_spec, size=cfg.model_size,
                               tiers=[b.model_size for b in behaviours] if behaviours else None)
    check_algorithm_models(cfg.algorithm, specs)
    ids = [node_name(i) for i in range(cfg.nodes)]
    policy = CompressionPolicy.from_config(
        cfg.compression, cfg.compression_kinds, error_feedback=cfg.error_feedback,
        consensus_step=cfg.consensus_step, keyframe_every=cfg.keyframe_every,
    )
    # the full graph is not built: no graph means every peer is a neighbour
    graph = None if cfg.topology == "full" else build_topology(cfg.topology, ids, cfg.seed, **cfg.topology_options)
    network = MemoryNetwork(latency=cfg.latency, presence_graph=graph if _presence_on_graph(cfg, graph, specs) else None)
    batcher = BatchTrainer() if cfg.batch else None
    federation = "sim"
    nodes: list[Node] = []
    for i, nid in enumerate(ids):
        data = make_node_data(bundle, parts[i], seed=cfg.seed)  # same split as the daemon (node_data_for)
        descriptor = {"algorithm": cfg.algorithm, "model_hash": spec_hash(specs[i]), "wires": list(SPOKEN)}
        behaviour = behaviours[i] if behaviours else None
        if behaviour is not None:
            descriptor.update(profile=behaviour.profile, roles=",".join(behaviour.roles))
        node = build_node(
            algo_cls, options, model_spec=specs[i], test_x=bundle.test.x, test_y=bundle.test.y,
            baseline_local=cfg.baseline_local, sink=sink, rounds=cfg.rounds, eval_every=cfg.eval_every,
            node_id=nid, federation=federation, transport=network.transport(nid, federation, descriptor),
            # the simulated presence at set-up is the only way peers are found: nothing to record
            peers=PeerTable(nid, federation, record_findings=False), data=data, train=_node_train(cfg, options, data),
            init_seed=init_seed_for(cfg.seed, i, cfg.init), rng=np.random.default_rng([cfg.seed, i]), device=device,
            graph_neighbours=None if graph is None else graph[nid], seed=cfg.seed,
            # no simulation-wide compression: the profile's (whole-model exchanges), if any
            compression=choose_compression(policy, behaviour, cfg.algorithm, error_feedback=cfg.error_feedback),
            behaviour=behaviour, batcher=batcher, straggler=straggler,
            # --speeds: a slow node's training takes more virtual time
            virtual_train_s=cfg.train_seconds / cfg.speeds[i % len(cfg.speeds)] if cfg.speeds else 0.0,
        )
        if i in cfg.kill:  # fault injection: the node crashes when it starts that round
            node.kill_at(cfg.kill[i], functools.partial(network.kill, nid))
        nodes.append(node)
    return _Federation(nodes, ids, spec, specs, behaviours, policy, batcher)


def _presence_on_graph(cfg: SimConfig, graph: dict[str, list[str]] | None, specs: list[dict[str, Any]]) -> bool:
    """Whether presence travels along the graph only (``MemoryNetwork(presence_graph=...)``),
    so that each node keeps peer-table entries for its graph neighbours alone and a node's
    state does not grow with N on a sparse graph.

    Yes for an algorithm of the neighbourhood family (it talks to its graph neighbours
    only: :func:`~dfl_agent.algorithms.base.traits_of`) on a graph, when every node trains
    the same model: no peer can then be excluded as incompatible, and the live count the
    records and the delivery rule use (:meth:`RuntimeContext.live_peer_count`) is the
    network's.  Other families (rotating aggregators, pairs, lock step) pick peers among
    all live members, and hear every member's presence as before.
    """
    if graph is None or traits_of(cfg.algorithm).family != "neighbourhood":
        return False
    return len({spec_hash(s) for s in specs}) == 1


def _node_train(cfg: SimConfig, options: Any, data: NodeData) -> TrainConfig:
    """A node's training configuration: ``cfg.train``, and under DP its own plan (σ for
    ``dp_epsilon`` over the whole run on its sample count; its DP steps capped at the plan's)."""
    dp = cfg.privacy()
    if dp is None:
        return cfg.train
    from dfl_agent.learning.dp import training_for
    from dfl_agent.privacy.plan import plan_run

    t, n = cfg.train, int(data.num_train)
    per_round = dp_steps_per_round(cfg.algorithm, options, n_samples=n, batch_size=t.batch_size, epochs=t.epochs,
                                   steps=t.steps)
    plan = plan_run(dp, n_samples=n, batch_size=t.batch_size, steps_per_round=per_round, rounds=cfg.rounds)
    return dataclasses.replace(t, dp=training_for(plan))


def _dp_summary(cfg: SimConfig, nodes: list[Node]) -> dict[str, Any] | None:
    """summary.json's ``dp``: per node the ε its DP steps spent (RDP, at ``dp_delta``), σ, q,
    the steps taken and C; fleet-wide the largest of each.  None without DP."""
    if cfg.dp_epsilon is None:
        return None
    from dfl_agent.privacy.accountant import rdp_epsilon

    per: dict[str, dict[str, Any]] = {}
    for n in nodes:
        dp = n.ctx.train.dp
        assert dp is not None  # every node trains under DP when cfg.dp_epsilon is set
        steps = dp.counter.taken
        per[n.ctx.node_id] = {
            "epsilon_spent": rdp_epsilon([(dp.noise_multiplier, dp.sample_rate, steps)], cfg.dp_delta) if steps else 0.0,
            "delta": cfg.dp_delta, "noise_multiplier": dp.noise_multiplier, "sample_rate": dp.sample_rate,
            "steps": steps, "steps_planned": dp.counter.limit, "max_grad_norm": dp.max_grad_norm,
        }
    fleet = {k: max(v[k] for v in per.values()) for k in ("epsilon_spent", "noise_multiplier", "sample_rate", "steps")}
    return {**fleet, "target_epsilon": cfg.dp_epsilon, "delta": cfg.dp_delta, "max_grad_norm": cfg.dp_max_grad_norm,
            "per_node": per}


def _run(cfg: SimConfig, fed: _Federation, device: str, progress: Callable[[int, float | None], None] | None) -> None:
    """Run every node's rounds on one virtual-time loop, with ``cfg.threads`` torch threads."""
    import torch

    async def run_node(node: Node) -> None:
        await node.setup()
        try:
            await node.run(cfg.rounds)
        except NodeKilled:
            node.set_state("killed")

    async def main() -> None:
        for node in fed.nodes:
            await node.ctx.start()
        if progress is not None:
            progress(0, None)  # set-up done: the rounds start
        await asyncio.gather(*(run_node(n) for n in fed.nodes))
        for node in fed.nodes:
            await node.ctx.stop()

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        run_virtual(main())
    finally:
        torch.set_num_threads(previous_threads)


def _summary(cfg: SimConfig, fed: _Federation, device: str, wall: float) -> dict[str, Any]:
    """The ``summary.json`` document of a finished run."""
    import torch

    nodes, ids, batcher = fed.nodes, fed.ids, fed.batcher
    # on CUDA: the run's peak of memory allocated by tensors (MiB; torch's caching
    # allocator may hold more)
    gpu = ({"device": device, "cuda_peak_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
            "cuda_device_name": torch.cuda.get_device_name(device)} if device != "cpu" else {})
    histories = {n.ctx.node_id: n.history for n in nodes}
    return metrics.summarize(
        cfg.algorithm, histories, wall_seconds=wall,
        bytes_by_node={n.ctx.node_id: (n.ctx.transport.stats.bytes_sent, n.ctx.transport.stats.bytes_received) for n in nodes},
        extra={
            "dataset": cfg.dataset, "partition": cfg.partition, "seed": cfg.seed, "model_spec": fed.spec,
            "model_specs": {nid: s for nid, s in zip(ids, fed.specs)}, "topology": cfg.topology,
            "dropped": {n.ctx.node_id: n.ctx.counters()["dropped"] for n in nodes},
            # aggregation/mutual-learning/transfer steps undone for a non-finite result, per node
            "diverged": {n.ctx.node_id: n.ctx.diverged for n in nodes},
            "curve": metrics.mean_curve(histories),
            "excluded": {n.ctx.node_id: dict(n.ctx.excluded) for n in nodes if n.ctx.excluded},
            "profiles": {nid: b.profile for nid, b in zip(ids, fed.behaviours)} if fed.behaviours else None,
            **_byte_summary(nodes, fed.policy),
            # batched training: node trainings done in vectorised groups, groups run, and
            # qualifying trainings that were alone in their group (None: --no-batch)
            # and evaluations done in vectorised passes (evaluated_batched, eval_groups, eval_single)
            "batching": {**batcher.stats, **batcher.eval_stats} if batcher is not None else None,
            "user_accuracy": metrics.user_accuracy(histories),  # UA: personal models on own splits, last 10 rounds
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),  # JSON-safe
            "dp": _dp_summary(cfg, nodes),  # differential privacy: the ε each node's training spent
            **gpu,
        },
    )


def _progress_sink(cfg: SimConfig, records: list[dict[str, Any]],
                   progress: Callable[[int, float | None], None]) -> Callable[[dict[str, Any]], None]:
    """A metrics sink that appends to ``records`` and calls ``progress`` once per round, in
    order, when every node not killed before that round has reported it."""
    seen: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    shown = [0]

    def expected(t: int) -> int:  # a node killed at round k reports rounds < k (O(killed), not O(N))
        return cfg.nodes - sum(1 for i, k in cfg.kill.items() if 0 <= i < cfg.nodes and k <= t)

    def sink(record: dict[str, Any]) -> None:
        records.append(record)
        t = int(record.get("round", 0))
        counts[t] = counts.get(t, 0) + 1
        if isinstance(record.get("global_accuracy"), (int, float)):
            seen.setdefault(t, []).append(float(record["global_accuracy"]))
        while counts.get(shown[0] + 1, 0) >= expected(shown[0] + 1) and shown[0] < cfg.rounds:
            shown[0] += 1
            accs = seen.pop(shown[0], [])
            counts.pop(shown[0], None)
            progress(shown[0], sum(accs) / len(accs) if accs else None)

    return sink


def sampled_parts(pool_size: int, nodes: int, k: int, seed: int) -> list[np.ndarray]:
    """``nodes`` index arrays of ``k`` distinct positions in ``[0, pool_size)`` each, drawn
    independently per node (with replacement across nodes), seeded by ``seed``.

    Raises:
        ValueError: ``k`` larger than the pool (a node cannot hold a sample twice).
    """
    if k > pool_size:
        raise ValueError(f"samples_per_node {k} > pool size {pool_size}")
    rng = np.random.default_rng([seed, 0x5A3])
    return [np.sort(rng.choice(pool_size, size=k, replace=False)) for _ in range(nodes)]


def _profile_behaviours(cfg: SimConfig) -> list[Behaviour] | None:
    """Each node's behaviour from ``cfg.profiles`` (cycled), or None without profiles.

    Raises:
        ValueError: unknown profile, or a profile that cannot run the algorithm.
    """
    if not cfg.profiles:
        return None
    from dfl_agent.profiles import get_profile, select_behaviour

    out = []
    for i in range(cfg.nodes):
        prof = get_profile(cfg.profiles[i % len(cfg.profiles)])
        if prof.inference_only:
            raise ValueError(f"profile {prof.name!r} is inference-only: it cannot be a simulated training node")
        out.append(select_behaviour(prof, cfg.algorithm, config_device=cfg.device, config_threads=cfg.threads,
                                    config_batch_size=cfg.train.batch_size))
    return out
def _byte_summary(nodes: list[Node], policy: CompressionPolicy) -> dict[str, Any]:
    """summary.json's compression and byte-accounting entries (issue 8)."""
    per_node = {n.ctx.node_id: n.ctx.byte_accounting() for n in nodes}
    by_kind: dict[str, int] = {}
    for acc in per_node.values():
        for k, v in acc["bytes_sent_by_kind"].items():
            by_kind[k] = by_kind.get(k, 0) + v
    f32, sent = sum(acc["float32_bytes_sent"] for acc in per_node.values()), sum(by_kind.values())
    return {
        "compression": str(policy.default),
        "compression_kinds": {k: str(v) for k, v in policy.kinds.items()},
        "error_feedback": policy.error_feedback,
        "consensus_step": policy.consensus_step,
        "bytes_sent_by_kind": by_kind,
        "bytes_sent_by_kind_per_node": {nid: acc["bytes_sent_by_kind"] for nid, acc in per_node.items()},
        "float32_bytes_sent": f32,
        "compression_ratio": f32 / sent if sent else 1.0,
    }
