"""The training agent: one node's part in one run, from its data to its last round.

:class:`Agent` loads the node's data (a data set, or a snapshot of the on-device sample
store), has :mod:`dfl_agent.runtime.shared.assembly` build the node, connects to its MQTT broker
(presence with a last will, status heartbeat), advertises itself and browses for peers
over mDNS, waits for ``discovery.min_peers`` peers (bounded by
``discovery.start_timeout``), then runs the algorithm for ``algorithm.rounds`` rounds,
resuming from its checkpoint.  Training runs in a worker thread, so messaging,
heartbeats and status go on meanwhile; every wait has a deadline.  A stop leaves
cleanly: mDNS goodbye, presence "offline".  After the last round the model is deployed
when the gate lets it.

The always-on agent creates one per run (:mod:`dfl_agent.runtime.service.run_manager`);
``dfl-agent run --once`` runs one for the configured run (:mod:`dfl_agent.runtime.service.daemon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.data import node_data_for
from dfl_agent.discovery.mdns import MdnsDiscovery
from dfl_agent.discovery.static import load_static_peers
from dfl_agent.learning.training import DEFAULT_LR, TrainConfig, warm_up
from dfl_agent.onnx_model import onnx_available
from dfl_agent.profiles import ResourceGate
from dfl_agent.runtime.node.build import build_node
from dfl_agent.runtime.node.checkpoint import snapshot_from_checkpoint
from dfl_agent.runtime.node.metrics import end_torn_line
from dfl_agent.runtime.node.node import init_seed_for
from dfl_agent.runtime.node.node_hooks import AfterRound, NodeHooks, RunStopped
from dfl_agent.runtime.run.deployment import deploy_after_run
from dfl_agent.runtime.run.dp_run import dp_sink, with_privacy
from dfl_agent.runtime.run.hosted_presence import HostedPresence
from dfl_agent.runtime.run.live_export import LiveExport
from dfl_agent.runtime.run.operations import AgentOperations
from dfl_agent.runtime.run.rejoin import RunMembers
from dfl_agent.runtime.run.warm_start import begin_run
from dfl_agent.runtime.shared.assembly import (
    StartupError,
    apply_profile,
    build_security,
    check_node_model,
    choose_compression,
    link_settings,
    model_spec_for,
    resolve_algorithm,
    straggler_policy,
)
from dfl_agent.runtime.shared.config import NodeConfig
from dfl_agent.runtime.shared.degraded import degraded_fields
from dfl_agent.runtime.shared.descriptor import RunDescriptor
from dfl_agent.runtime.shared.model_handover import WANTED_FIELD
from dfl_agent.runtime.shared.pipe import End, RunCounters, StateReport, StatusReport, run_drops
from dfl_agent.runtime.shared.preflight import load_data
from dfl_agent.runtime.shared.run_config import node_id_from_state
from dfl_agent.runtime.shared.run_host import RunHost
from dfl_agent.runtime.shared.sample_store import SNAPSHOT_KEY, open_store, store_data
from dfl_agent.transport.mqtt import MqttTransport
from dfl_agent.transport.versions import descriptor_versions

log = logging.getLogger("dfl_agent.daemon")


@dataclasses.dataclass
class _Setup:
    """What :meth:`Agent._prepare` chose: the algorithm and its options, the device
    profile and behaviour, the data, the model spec, the keys and the training settings."""

    algo_cls: Any
    options: Any
    profile: Any
    behaviour: Any
    bundle: Any
    data: Any
    spec: dict[str, Any]
    guard: Any
    train: Any
    link: Any = None  # LinkTimings (mqtt.link_rate) and the heartbeat timeout it implies
    heartbeat_timeout: float = 30.0


class Agent(RunMembers, AgentOperations):
    """One running daemon: wires config, data, transport, discovery and the algorithm."""

    def __init__(self, cfg: NodeConfig, config_path: str | None = None, psutil_mod: Any = None, *,
                 host: RunHost, run: RunDescriptor | None = None, run_id: str | None = None,
                 run_dir: Path | None = None):
        self.cfg = cfg
        #: the service around the run (:class:`~dfl_agent.runtime.shared.run_host.RunHost`; in a run process
        #: its :class:`~dfl_agent.runtime.run.run_process.RunChannel`): it publishes the node's presence
        #: and status, records the run's states after its rounds, ingests the sample store,
        #: switches ``current`` and announces the deployment
        self.host = host
        #: the run trained (None: ``dfl-agent run --once``'s run, whose files stay in the state
        #: directory: ``checkpoints/``, ``runtime.metrics_file``) and its folder
        self.run_desc, self.run_dir = run, run_dir
        #: the run's id: the descriptor's, else the one its supervisor gave (``--once``)
        self.run_id = run.run_id if run is not None else run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        #: the run's members besides this node, whose majority may say that the run is
        #: finished: the admitted members the host names, those recorded in ``members.json``
        #: of the run's folder, and the live verified neighbours when the node starts its
        #: rounds (see :meth:`_members`)
        self.members: set[str] = set(host.members())
        self.outcome = "starting"
        self.psutil = psutil_mod  # None = the real psutil (tests pass a stand-in for battery etc.)
        self.state_dir = Path(cfg.state_dir)
        self.node_id = ""
        self.node: Any = None
        self.mdns: Any = None
        self.ctx: Any = None
        # -- operations: checkpoints, SIGHUP reload (config_path: node.toml)
        self.config_path = config_path
        self.checkpointer: Any = None
        self.metrics_path: Path | None = None  # the metrics file of the run (read on resume)
        self.metrics_run: str | None = None
        self.peers: Any = None
        # -- the sample store and model delivery
        self.store: Any = None
        self.snapshot: Any = None
        self.deployed: Any = None  # the last deploy result
        self.start: dict[str, Any] = {}  # the run's start (runtime.warm_start): init, started_from, reason
        self.publisher: LiveExport | None = None  # exports the model for inference-only members
        #: the node's after-round hooks (:class:`~dfl_agent.runtime.node.node_hooks.NodeHooks`)
        self.after_round: list[AfterRound] = []
        #: the data's (input shape, number of classes), once loaded (runs: accept-time memory check)
        self.data_shape: tuple[Any, int | None] | None = None
        #: the run ended on most of its members before this node's last round (:mod:`.adoption`)
        self.finished_elsewhere = False
        #: the request for the run's model in this node's status (``model_wanted``), while it asks
        self.wanted: dict[str, Any] | None = None
        self.missed_reason = ""  # why the run ended ``missed`` here (no member could provide its model)
        #: the link rate (bits/s; None: fast) and the peers' heartbeat timeout (s), from the setup
        self.link_bps: float | None = None
        self.heartbeat_timeout = 30.0

    async def run(self, stop: asyncio.Event) -> int:
        """Train this node's run until its last round or ``stop`` (then leave cleanly).
        Returns the exit code: 0, or 3 when the broker is unreachable.

        Raises:
            StartupError: the algorithm, an option, the profile, the data, the model spec
                or the keys are unusable.
        """
        s = self._prepare()
        self.link_bps, self.heartbeat_timeout = getattr(s.link, "bps", None), s.heartbeat_timeout
        transport, mdns_descriptor = self._transport(s)
        metrics_file, sink = self._open_metrics()
        self._build(s, transport, dp_sink(sink, s.train), stop)  # round records count their DP steps
        self._attach_publisher(s)
        return await self._lifecycle(stop, s.spec, s.bundle.pool.input_shape, mdns_descriptor, metrics_file)

    # -- assembly: what the node is made of -------------------------------------------------
    def _prepare(self) -> _Setup:
        """Every start-up check and choice before the network: node id, algorithm and
        options, device profile and behaviour, data, model spec, keys, training settings.

        Raises:
            StartupError: naming what is unusable.
        """
        import torch

        cfg = self.cfg
        d = cfg.data
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.node_id = nid = node_id_from_state(self.state_dir, cfg.node_id)
            algo_cls, options = resolve_algorithm(cfg)  # ConfigError (a ValueError) names the key
            profile, behaviour = apply_profile(cfg, algo_cls.name)  # device profile + decision table
            torch.set_num_threads(behaviour.threads)
            if d.dataset == "store":  # the on-device sample store (dfl_agent.store)
                bundle, data = self._store_data()
            else:
                bundle = load_data(cfg)
                data = node_data_for(bundle, d.num_nodes, d.node_index, d.partition, seed=cfg.seed, beta=d.beta,
                                     zeta=d.zeta)
            spec = model_spec_for(cfg, algo_cls.name, bundle.pool.input_shape, bundle.pool.num_classes,
                                  profile_size=profile.model.size, tier=behaviour.model_size)
            self.data_shape = (list(bundle.pool.input_shape), int(bundle.pool.num_classes))
            check_node_model(algo_cls.name, spec, bundle.pool.num_classes)
            behaviour = apply_profile(cfg, algo_cls.name, spec=spec)[1]  # aggregator memory check
            link, options, heartbeat_timeout = link_settings(cfg, options, spec)  # mqtt.link_rate
            guard = build_security(cfg, self.state_dir, nid)  # -- security
        except (ValueError, KeyError, OSError, ImportError, LookupError) as exc:
            raise StartupError(str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)) from None
        if behaviour.reasons:  # one line (the full table: dflctl profile show)
            log.info("profile %s: %s", profile.name, "; ".join(behaviour.reasons))
        if hint := algo_cls.common_init_hint(options, cfg.runtime.init, d.partition):
            log.warning("%s", hint)
        t = cfg.training
        train = TrainConfig(epochs=t.epochs, steps=t.steps, batch_size=behaviour.batch_size, momentum=t.momentum,
                            lr=DEFAULT_LR if t.lr is None else t.lr, lr_is_set=t.lr is not None, weight_decay=t.weight_decay,
                            mixed_precision=behaviour.mixed_precision, clip_grad_norm=t.clip_grad_norm,
                            divergence_factor=t.divergence_factor)
        train = with_privacy(cfg, profile, algo_cls.name, options, data.num_train, train, self.run_dir)  # privacy.dp
        log.info("node %s of federation %s: %s, %d train / %d val samples (users %s), model %s",
                 nid, cfg.federation, algo_cls.name, data.num_train, len(data.val_y), data.groups, spec["type"])
        return _Setup(algo_cls, options, profile, behaviour, bundle, data, spec, guard, train, link, heartbeat_timeout)

    def _transport(self, s: _Setup) -> tuple[Any, dict[str, Any]]:
        """The peer table (static peers loaded) and the MQTT transport with this node's
        presence descriptor; returns the transport and the descriptor mDNS advertises."""
        from dfl_agent.discovery.peers import PeerTable
        from dfl_agent.models import spec_hash

        cfg, nid, fed = self.cfg, self.node_id, self.cfg.federation
        if cfg.mqtt.bridged:  # operations: multi-site, brokers joined by bridging
            from dfl_agent.discovery.bridged import HomeRoutedPeerTable as PeerTable  # noqa: N814
        self.peers = peers = PeerTable(nid, fed, heartbeat_timeout=s.heartbeat_timeout)
        load_static_peers(peers, cfg.discovery.static_peers, fed)
        peers.home_broker = cfg.mqtt.broker  # a presence from another site's broker is a bridged one
        descriptor = {
            "broker": cfg.mqtt.broker, "profile": cfg.profile, "model_hash": spec_hash(s.spec),
            "algorithm": s.algo_cls.name, "version": descriptor_versions()["version"],
            "roles": ",".join(s.behaviour.roles), "compression": s.behaviour.compression,
        }
        mdns_descriptor = dict(descriptor)  # mDNS advertises the address and the wire versions itself
        descriptor["wires"] = descriptor_versions()["wires"]  # what peers write to this node in (negotiate)
        if cfg.discovery.interfaces:  # the device's own address (dflctl peers), as mDNS advertises it
            descriptor["address"] = str(cfg.discovery.interfaces[0])
        if s.guard.certificate is not None:
            descriptor["cert"] = s.guard.certificate  # presence carries the device certificate

        def on_heartbeat(peer: str, status: dict[str, Any]) -> None:
            peers.touch(peer)
            if self.ctx:
                self.ctx.note_status(peer, status)

        presence = HostedPresence(nid, fed, descriptor=descriptor, heartbeat_interval=cfg.mqtt.heartbeat_interval,
                                  on_heartbeat=on_heartbeat, control=s.guard, host=self.host, report=self.status_report)
        transport = MqttTransport(
            nid, fed, channel=presence, broker=cfg.mqtt.broker, peers=peers, protocol=cfg.mqtt.protocol,
            max_frame_bytes=cfg.mqtt.max_frame_bytes, **s.link.transport_args(),
            username=cfg.mqtt.username, password=cfg.mqtt.password,
            tls_ca=cfg.mqtt.tls_ca, tls_cert=cfg.mqtt.tls_cert, tls_key=cfg.mqtt.tls_key,
            max_transfers=cfg.mqtt.max_transfers,
        )
        return transport, mdns_descriptor

    def _open_metrics(self) -> tuple[Any, Callable[[dict[str, Any]], None]]:
        """Open the run's metrics file for appending (``runs/{id}/metrics.jsonl``, else
        ``runtime.metrics_file``); returns it and the sink that writes one record a line."""
        cfg = self.cfg
        run_id = self.run_desc.run_id if self.run_desc is not None else None
        if self.run_dir is not None:  # runs: metrics per run
            metrics_path = self.run_dir / "metrics.jsonl"
        else:
            metrics_path = Path(cfg.runtime.metrics_file or self.state_dir / "metrics.jsonl")
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        end_torn_line(metrics_path)
        metrics_file = open(metrics_path, "a", encoding="utf-8")
        self.metrics_path, self.metrics_run = metrics_path, run_id

        def sink(record: dict[str, Any]) -> None:
            if run_id is not None:
                record = {**record, "run": run_id}
            metrics_file.write(json.dumps(record, sort_keys=True, default=float) + "\n")
            metrics_file.flush()

        return metrics_file, sink

    def _build(self, s: _Setup, transport: Any, sink: Callable[[dict[str, Any]], None], stop: asyncio.Event) -> None:
        """The node (:func:`~dfl_agent.runtime.shared.assembly.build_node`): its context over
        ``transport``, its algorithm, evaluation and metrics ``sink``, and every hook it calls
        (``stop``: the run's stop, checked after every round)."""
        cfg, d = self.cfg, self.cfg.data
        profile, behaviour = s.profile, s.behaviour
        persistent: dict[str, Any] = {}
        if self.snapshot is not None:  # saved with every checkpoint: a resumed run trains on the same data
            persistent[SNAPSHOT_KEY] = self.snapshot
        self.node = node = build_node(
            s.algo_cls, s.options, model_spec=s.spec, test_x=s.bundle.test.x, test_y=s.bundle.test.y,
            baseline_local=cfg.runtime.baseline_local, sink=sink, rounds=cfg.algorithm.rounds,
            eval_every=cfg.runtime.eval_every, eval_background=cfg.runtime.eval_background,
            node_id=self.node_id, federation=cfg.federation, transport=transport, peers=self.peers, data=s.data,
            train=s.train, init_seed=init_seed_for(cfg.seed, d.node_index, cfg.runtime.init),
            rng=np.random.default_rng([cfg.seed, d.node_index]), device=behaviour.device, compute_in_thread=True,
            max_frame_bytes=cfg.mqtt.max_frame_bytes, graph_neighbours=cfg.algorithm.neighbours, seed=cfg.seed,
            compression=choose_compression(cfg.compression.policy(), behaviour, s.algo_cls.name,
                                           error_feedback=cfg.compression.error_feedback),
            security=s.guard, max_queued_per_sender=cfg.security.max_queued_per_sender, behaviour=behaviour,
            gate=ResourceGate(profile.limits, profile.training.windows, psutil_mod=self.psutil),
            gate_poll=profile.limits.poll_interval_s, pause_when_disconnected=cfg.runtime.pause_when_disconnected,
            max_catch_up_rounds=cfg.runtime.max_catch_up_rounds, final_round=cfg.algorithm.rounds,
            persistent_state=persistent,
            straggler=straggler_policy(cfg),  # runtime.straggler: quorum, adaptive deadlines
            alone_waits=self._alone_waits,  # no racing ahead alone while members are away
            hooks=NodeHooks(needs_peers=lambda: cfg.discovery.min_peers > 0 or bool(self.members),  # else alone is
                            stop_check=stop.is_set,  # no failure; checked after every round (a stop, a cancel)
                            finish_check=self._finished_by_members, checkpoint=self._checkpoint,
                            after_round=self.after_round),
            # no global test set with the sample store: "global" accuracy is the validation slice's
            accuracy_source="local validation" if self.store is not None else None,
            run_info={"id": self.metrics_run, "state": "accepted", "reason": ""} if self.metrics_run is not None else None,
            lr_ramp=cfg.training.warm_start_ramp)  # a warm start's ramp
        self.ctx = node.ctx

    def _finished_by_members(self) -> bool:
        """Checked while waiting for peers and after every round but the last: most of the run's
        members report it finished (``runtime.rejoin`` and an algorithm that communicates)."""
        return self.cfg.runtime.rejoin and self.node.algorithm.communicates and self._federation_finished()

    async def _checkpoint(self, t: int) -> None:
        """Round ``t``'s crash-safe checkpoint (``runtime.checkpoint``; see :meth:`_resume`)."""
        if self.checkpointer is not None:
            await self.checkpointer.save_async(t)

    def _attach_publisher(self, s: _Setup) -> None:
        """With ONNX available and no deployment: export the deployable model after every round
        that improved it while inference-only members are live (:mod:`dfl_agent.runtime.run.live_export`);
        the service sends it to them (with deployment, it sends the deployed version)."""
        if not onnx_available() or self.cfg.deploys:
            return
        node = self.node
        self.publisher = LiveExport(self.state_dir, self.peers, node.reported_model, s.bundle.pool.input_shape, s.spec,
                                    self.run_id, self.ctx.compute_ungated, private=node.algorithm.private())
        self.after_round.append(self.publisher)

    # -- the node's life: start, join, rounds, teardown ---------------------------------------
    async def _lifecycle(self, stop: asyncio.Event, spec: dict[str, Any], input_shape: Any,
                         mdns_descriptor: dict[str, Any], metrics_file: Any) -> int:
        """Start the node's services, run its rounds, and tear everything down in reverse
        order (an :class:`contextlib.AsyncExitStack`) however it ends.  Returns the exit code
        (3: the broker is unreachable)."""
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(metrics_file.close)
            stack.push_async_callback(self.ctx.stop)
            if not await self._start_services(stack, mdns_descriptor):
                return 3
            start_round = await self._setup(stack, spec)
            resumed = start_round is None or start_round > 1
            if start_round is not None:
                start_round = await self._join(stop, start_round)
            if start_round is None:  # all rounds done before a restart, or the members ended the run
                if self.outcome == "finished" and self.run_desc is not None:
                    if self.finished_elsewhere and self.cfg.deploys:  # it missed the run's end:
                        await self._adopt(spec, input_shape, resumed)  # the run's model from a member
                    elif resumed:
                        self._tell("trained", start=self.start)  # it ends with its checkpoint's model,
                        await self._after_run(spec, input_shape)  # deployed or kept once
                return 0
            await self._run_rounds(stop, start_round, spec, input_shape)
            return 0

    async def _start_services(self, stack: contextlib.AsyncExitStack, mdns_descriptor: dict[str, Any]) -> bool:
        """Connect to the broker and advertise on mDNS (each stopped by ``stack``).  False when
        the broker is unreachable."""
        try:
            await self.ctx.start()
        except ConnectionError as exc:
            log.error("%s", exc)
            return False
        cfg = self.cfg
        if cfg.discovery.mdns:
            self.mdns = MdnsDiscovery(self.peers, node_id=self.node_id, federation=cfg.federation,
                                      descriptor=mdns_descriptor, interfaces=list(cfg.discovery.interfaces))
            stack.push_async_callback(self.mdns.stop)
            await self.mdns.start()
        return True

    async def _setup(self, stack: contextlib.AsyncExitStack, spec: dict[str, Any]) -> int | None:
        """Set the algorithm up and restore the checkpoint.  Returns the first round to run,
        None when the checkpoint says every round is done."""
        from dfl_agent.models import spec_hash

        node, rounds, cfg, t = self.node, self.cfg.algorithm.rounds, self.cfg, self.cfg.training
        await node.setup()
        start_round = self._resume(spec_hash(spec))  # operations: crash-safe state
        self.start = begin_run(node.algorithm, self.state_dir, self.run_dir, cfg.runtime.run_init,
                               start_round > 1, t.warm_start_probe, t.warm_start_ramp)  # warm start
        node.start_from(self.start)
        self.members |= self._load_members(resumed=start_round > 1)
        await node.publish_status()
        if start_round > rounds:
            log.info("the checkpoint says all %d rounds are done; %s", rounds,
                     "nothing to run" if self.run_desc is None else "the run goes on with its deployment")
            node.set_state("finished")
            self.outcome = "finished"
            await node.publish_status()
            return None
        return start_round

    async def _join(self, stop: asyncio.Event, start_round: int) -> int | None:
        """Warm torch up while waiting for peers, then (``runtime.rejoin``) catch up with a
        running federation.  Returns the round to start at, None when there is nothing to
        run (stopped, or most of the run's members report it finished)."""
        node, cfg = self.node, self.cfg
        # start-up work (torch's lazy initialisation) while waiting for peers, not in round 1
        warm = asyncio.ensure_future(self._warm_up(node, node.ctx.data))
        if not await self._wait_for_peers(stop):
            warm.cancel()
            return None
        node.note_startup("warm_up_s", await warm)
        if cfg.runtime.rejoin and node.algorithm.communicates:  # fault tolerance: behind the federation
            if self._federation_finished():  # a majority of the run's members, never one device
                log.info("most of the run's members report it finished (%d rounds)", cfg.algorithm.rounds)
                self.outcome = "finished"
                self.finished_elsewhere = True
                return None
            start_round = self._rejoin_round(start_round)
            self.ctx.enable_catch_up()  # ... and, while running, behind its neighbours
        self._save_members()
        return start_round

    async def _run_rounds(self, stop: asyncio.Event, start_round: int, spec: dict[str, Any],
                          input_shape: Any) -> None:
        """The rounds from ``start_round``, until the last one (then deploy) or a stop or
        cancel (the completed rounds' records are written first)."""
        node, ctx, rounds = self.node, self.ctx, self.cfg.algorithm.rounds
        # (a stop, or a cancel's SIGTERM, mid-round also cancels the round in progress)
        run = asyncio.ensure_future(node.run(rounds, start_round))
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
        between = run in done and isinstance(run.exception(), RunStopped)
        if run in done and not between:
            stopper.cancel()
            run.result()  # re-raise a crash of the algorithm
            if node.last_round() >= rounds:  # else the node said after which round it stopped (members finished)
                log.info("finished %d rounds", rounds)
            self.outcome = "finished"
            self._tell("trained", start=self.start)
            await self._after_run(spec, input_shape)
            return
        log.info("stop requested %s; leaving the federation",
                 f"after round {node.last_round()}" if between else f"during round {node.last_round() + 1}")
        if ctx.abort is not None:  # local training in the worker thread stops too
            ctx.abort.set()
        # the completed rounds' records (evaluated in the background) are written before the round in progress is abandoned
        drainer = asyncio.ensure_future(node.drain())
        await asyncio.wait({drainer}, timeout=30.0)
        stopper.cancel()
        run.cancel()
        await asyncio.gather(run, stopper, drainer, return_exceptions=True)
        node.set_state("stopped")
        self.outcome = "stopped"
        await node.publish_status()

    # -- the sample store and model delivery ----------------------------------------------
    def _store_data(self) -> tuple[Any, Any]:
        """Open (and seed) the store, ingest the spool, take the run's snapshot (or the one
        saved with the checkpoint being resumed), and split it."""
        d = self.cfg.data
        self.store = store = open_store(self.cfg)
        ids = snapshot_from_checkpoint(self.run_dir or self.state_dir, self.cfg.algorithm.rounds) if self.cfg.runtime.checkpoint else None
        if ids is None:
            ids = store.snapshot()
        else:
            log.info("resuming with the data snapshot of the checkpoint (%d samples)", len(ids))
        self.snapshot = ids
        bundle, data = store_data(store, ids, d.validation_share)
        log.info("sample store: run snapshot of %d samples (%d train, %d validation; store holds %d)",
                 len(ids), data.num_train, data.num_val, store.count())
        return bundle, data

    async def _after_run(self, spec: dict[str, Any], input_shape: Any, reason: str = "") -> None:
        """After a run's last round: deploy the model when the gate lets it (dfl_agent.deploy).
        ``reason``: why this model and not the run's final one (recorded with the outcome)."""
        if not self.cfg.deploys:
            return
        self._tell("deploying")
        try:
            self.deployed = await deploy_after_run(self, spec, input_shape)
        except Exception as exc:  # noqa: BLE001 - a failed deployment never crashes the agent
            log.error("deployment failed: %s", exc)
            return
        ok = self.deployed.get("deployed")
        note = "; ".join(x for x in (reason, "" if ok else str(self.deployed.get("note") or "")) if x)
        self._tell("deployed" if ok else "kept", version=self.deployed.get("version"), reason=note)

    async def _adopt(self, spec: dict[str, Any], input_shape: Any, resumed: bool) -> None:
        """The run ended on its members while this node was away: take its model from a member
        that deployed it (:func:`~dfl_agent.runtime.run.adoption.adopt`), through the deploy gate.
        Where no member can provide it, a node that trained rounds of the run (``resumed``)
        deploys its checkpoint's model through the gate, as before; one that trained none ends
        the run ``missed``."""
        from dfl_agent.runtime.run.adoption import adopt

        got = await adopt(self, spec, input_shape, bps=self.link_bps, heartbeat_timeout=self.heartbeat_timeout)
        if got.state != "missed":
            self._tell(got.state, version=got.version, source=got.source, reason=got.reason)
            self.node.set_state("finished")
            await self.node.publish_status()
            return
        if resumed:
            log.warning("run %s: %s; the model of this node's checkpoint goes to the deploy gate",
                        self.run_id, got.reason)
            self._tell("trained", start=self.start, reason=got.reason)
            await self._after_run(spec, input_shape, got.reason)
            return
        log.warning("run %s missed: it ended on its members while this node was away, and %s", self.run_id, got.reason)
        self.outcome, self.missed_reason = "missed", got.reason

    def _tell(self, state: str, **info: Any) -> None:
        """Tell the host the run's state after its rounds (``info``: ``version`` for ``deployed``
        and ``adopted``, ``start`` for ``trained``, ``source`` of an adopted model, ``reason``);
        the host returns once it recorded it.

        Raises:
            HostGone: the host did not record it.
        """
        st = self.node.status() if self.node is not None else {}
        snap = self.snapshot
        self.host.record_state(StateReport(
            state, 0, round=int(st.get("round", 0)), snapshot_last_id=int(snap.max()) if snap is not None
            and len(snap) else None, version=info.get("version"), start=info.get("start") or None,
            degraded=degraded_fields(st) if "rounds_alone" in st else {}, source=info.get("source"),
            reason=info.get("reason") or None))

    def status_report(self, status: dict[str, Any]) -> StatusReport:
        """``status`` with the node's counters, live peers and last checkpoint's round, for the host."""
        node = self.node
        counters: RunCounters | None = None
        peers: tuple[str, ...] | None = None
        if node is not None:
            c = node.ctx.counters()
            counters = RunCounters(int(c["bytes_sent"]), int(c["bytes_received"]), dict(c["dropped"]),
                                   int(c.get("diverged", 0)))
            peers = tuple(node.ctx.live_peers())
        saved = self.checkpointer.last_saved if self.checkpointer is not None else 0
        if self.wanted is not None:  # asking a member for the run's model (runtime.run.adoption)
            status = {**status, WANTED_FIELD: dict(self.wanted)}
        return StatusReport(dict(status), counters, peers, int(saved or 0))

    def end_report(self) -> End:
        """How the run ended here (the host's last message from the run process)."""
        node, snap = self.node, self.snapshot
        shape = list(self.data_shape) if self.data_shape is not None else None
        return End(self.outcome, int(node.status().get("round", 0)) if node is not None else 0,
                   node.last_round() if node is not None else 0, shape,
                   int(snap.max()) if snap is not None and len(snap) else None,
                   run_drops(node.ctx.counters()["dropped"] if node is not None else None),
                   reason=self.missed_reason or None)

    async def _warm_up(self, node: Any, data: Any) -> float:
        """Torch's one-time start-up work on a copy of the model (see
        :func:`dfl_agent.learning.training.warm_up`), in the compute thread; returns its
        seconds (0 when the algorithm has no trainable model or it failed)."""
        try:
            model = node.algorithm.deployable_model()
            secs = await node.ctx.compute_ungated(warm_up, model, data.train_x, data.train_y, node.ctx.train,
                                                  node.ctx.device)
        except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation only
            log.debug("warm-up skipped: %r", exc)
            return 0.0
        log.info("start-up: torch warmed up in %.1f s (before round 1)", secs)
        return round(float(secs), 3)

    async def _wait_for_peers(self, stop: asyncio.Event) -> bool:
        """Wait until ``discovery.min_peers`` peers are live or ``start_timeout`` passes.

        Returns False when a stop was requested meanwhile."""
        want = self.cfg.discovery.min_peers
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.discovery.start_timeout
        self.node.set_state("waiting_for_peers")

        def wanted() -> int:  # at most this many peers can still come (the others that did not decline the run)
            return min(want, int(self.host.may_join()))

        # (runtime.rejoin: most members already finished the run, nobody to wait for)
        while len(self.ctx.live_peers()) < wanted() and loop.time() < deadline and not self._finished_by_members():
            if stop.is_set():
                return False
            await asyncio.sleep(0.2)
        # device profiles: give live peers a moment (<= 3 s) to announce their descriptor
        # (presence), so incompatible ones are excluded before round 1, not after a timeout
        settle = min(deadline, loop.time() + 3.0)
        while loop.time() < settle and not stop.is_set() and any(
            not getattr(self.ctx.peers.get(p), "algorithm", "") for p in self.ctx.peers.live_peers()
        ):
            await asyncio.sleep(0.1)
        live = self.ctx.live_peers()
        if wanted() < want:
            log.info("waiting for %d peers, not discovery.min_peers %d: the others declined the run", wanted(), want)
        if len(live) < wanted():
            log.warning("only %d of %d peers after %.0fs; starting anyway", len(live), want,
                        self.cfg.discovery.start_timeout)
        log.info("peers: %s", ", ".join(live) or "none")
        return not stop.is_set()
