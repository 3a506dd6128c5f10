"""``dflctl demo --feed``: live data in, validated models out, on real agent processes.

Starts an MQTT broker on a free loopback port and N always-on ``dfl-agent run``
processes that train on their on-device sample store (``data.dataset = "store"``),
one HAR user per agent.  Each agent starts with a small share of its user's windows
in its spool; a feeder thread then writes the user's next windows into every spool
at a fixed rate (atomically: temporary name, then rename), as the device's
application would.  The first run is the agents' default run (``[algorithm]``); each
further run is submitted, signed by an operator key, once every agent has finished the
previous one and its store has grown.  After each run every agent evaluates its model
on its current validation slice and deploys it when the gate lets it.

The final table shows, per agent and run, the samples the run trained on, the model
version it deployed and that version's validation accuracy (and, with the onnx extra,
its accuracy on the held-out HAR test users).  The report folder holds ``summary.json``
(see :func:`feed_federation`), per-agent logs, state directories and ``feed.jsonl``.
Ctrl-C stops the agents at once (as :func:`dfl_agent.cli.demo.run_demo` does) and still writes
``summary.json``, marked ``"complete": false, "interrupted": true``, with the run and round each
agent last reported (``reported``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dfl_agent.algorithms.protocols.stragglers import REPRODUCTION_MODE
from dfl_agent.runtime.shared.config import (
    AlgorithmSection,
    DataSection,
    DeploySection,
    DiscoverySection,
    ModelSection,
    MqttSection,
    NodeConfig,
    RuntimeSection,
    SecuritySection,
    TrainingSection,
    dump_toml,
)


@dataclasses.dataclass
class FeedOptions:
    """Arguments of ``dflctl demo --feed`` (see ``dflctl demo --help``)."""

    nodes: int = 3
    runs: int = 2
    rounds: int = 3
    algorithm: str = "fedavg"
    out: str = "dfl-demo-feed"
    broker: str = "auto"
    seed: int = 0
    epochs: int = 1
    initial: float = 0.25  # share of each user's windows in the spool when the agents start
    feed_interval: float = 2.0  # seconds between the feeder's passes
    feed_chunk: int = 16  # windows per agent per pass
    max_windows: int | None = None  # per user (small demos and tests)
    round_timeout: float = 60.0
    start_timeout: float = 300.0
    live: bool | None = None
    model_size: str = "small"
    min_validation: int = 5  # deploy.min_validation of the agents (small stores)
    straggler: str = REPRODUCTION_MODE  # runtime.straggler of every agent


def _npz_bytes(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x.astype(np.float32), y=y.astype(np.int64), t=np.full(len(y), time.time()))
    return buf.getvalue()


def drop_into_spool(spool: Path, name: str, x: np.ndarray, y: np.ndarray) -> Path:
    """Write one sample file the way an application must: a temporary (hidden) name in the
    spool, then an atomic rename to ``name``.  Returns the final path."""
    from dfl_agent.fsutil import atomic_write

    spool.mkdir(parents=True, exist_ok=True)
    atomic_write(spool / name, _npz_bytes(x, y))
    return spool / name


class Feeder(threading.Thread):
    """Adds each user's next windows to its agent's spool every ``interval`` seconds.

    Args:
        spools: node id -> spool folder.
        data: node id -> ``(x, y)`` of the user's windows, in recording order.
        start: node id -> windows already given (the feeder continues from there).
        chunk: windows per agent per pass.
        interval: seconds between passes.
        log_path: ``feed.jsonl`` (one line per file written: time, node, windows, total).
    """

    def __init__(self, spools: dict[str, Path], data: dict[str, tuple[np.ndarray, np.ndarray]],
                 start: dict[str, int], chunk: int, interval: float, log_path: Path | None = None):
        super().__init__(daemon=True, name="feeder")
        self.spools, self.data, self.pos = spools, data, dict(start)
        self.chunk, self.interval, self.log_path = chunk, interval, log_path
        self.stop_event = threading.Event()
        self.passes = 0
        self.events: list[dict[str, Any]] = []
        #: node id -> feed up to this many windows (the scenario raises it run by run)
        self.limit = dict(start)

    def remaining(self) -> int:
        """Windows not yet fed, over all agents."""
        return sum(len(self.data[n][1]) - self.pos[n] for n in self.data)

    def pending(self) -> int:
        """Windows allowed by ``limit`` but not yet fed, over all agents."""
        return sum(max(0, min(self.limit[n], len(self.data[n][1])) - self.pos[n]) for n in self.data)

    def run(self) -> None:
        while not self.stop_event.is_set() and self.remaining() > 0:
            t0 = time.monotonic()
            wrote = False
            for nid, (x, y) in self.data.items():
                a = self.pos[nid]
                b = min(len(y), a + self.chunk, self.limit[nid])
                if b <= a:
                    continue
                wrote = True
                drop_into_spool(self.spools[nid], f"feed-{a:06d}.npz", x[a:b], y[a:b])
                self.pos[nid] = b
                self.events.append({"time": time.time(), "node": nid, "windows": b - a, "total": b})
                if self.log_path is not None:
                    with open(self.log_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(self.events[-1]) + "\n")
            if wrote:
                self.passes += 1
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - t0)) if wrote else 0.2)

    def stop(self) -> None:
        self.stop_event.set()


def _users(opts: FeedOptions) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]], Any]:
    """Node ids (``userNN``), each user's windows, and the HAR bundle."""
    from dfl_agent.data import load_dataset

    bundle = load_dataset("har")
    pool = bundle.pool
    users = sorted({int(u) for u in pool.groups})
    if opts.nodes > len(users):
        raise ValueError(f"--nodes {opts.nodes}: HAR has only {len(users)} users outside the test group")
    data = {}
    for u in users[:opts.nodes]:
        m = pool.groups == u
        x, y = pool.x[m], pool.y[m]
        if opts.max_windows:
            x, y = x[:opts.max_windows], y[:opts.max_windows]
        data[f"user{u:02d}"] = (x, y)
    return list(data), data, bundle


def _config(opts: FeedOptions, fed: str, nid: str, state: Path, broker: str, pool: Any,
            federation_key: str) -> NodeConfig:
    return NodeConfig(
        security=SecuritySection(require_signatures=True, federation_key=federation_key),
        federation=fed, node_id=nid, state_dir=str(state), seed=opts.seed, profile="generic-x86",
        profile_overrides={"limits": {"max_load_per_core": 0}, "training": {"windows": []}},
        algorithm=AlgorithmSection(name=opts.algorithm, rounds=opts.rounds,
                                   options={"round_timeout": opts.round_timeout} if opts.algorithm == "fedavg"
                                   else {}),
        model=ModelSection(size=opts.model_size),
        training=TrainingSection(epochs=opts.epochs, threads=1),
        data=DataSection(dataset="store", input_shape=list(pool.input_shape), num_classes=pool.num_classes,
                         class_names=list(pool.class_names), spool_interval=1.0),
        deploy=DeploySection(keep=max(3, opts.runs + 1), min_validation=opts.min_validation),
        mqtt=MqttSection(broker=broker, heartbeat_interval=1.0),
        discovery=DiscoverySection(mdns=False, min_peers=opts.nodes - 1, start_timeout=opts.start_timeout,
                                   heartbeat_timeout=30.0),
        runtime=RuntimeSection(straggler=opts.straggler),
    )


def _store_count(state: Path) -> int:
    from dfl_agent.store.sqlite import SampleStore, StoreError

    try:
        s = SampleStore(state, None, create=False)
    except (StoreError, OSError):
        return 0
    try:
        return int(s.count())
    finally:
        s.close()


def _terminal_runs(state: Path) -> list[str]:
    """Run ids that reached a terminal state on this agent, in the order they did."""
    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.shared.descriptor import TERMINAL

    e = RunLedger(state).entries
    return [r for r, v in sorted(e.items(), key=lambda kv: kv[1].get("time", 0)) if v.get("state") in TERMINAL]


def _heldout_accuracy(folder: Path, x: np.ndarray, y: np.ndarray) -> float | None:
    """Accuracy of a deployed version's ``model.onnx`` on the held-out users (None without it)."""
    if not (folder / "model.onnx").is_file():
        return None
    try:
        from dfl_agent.onnx_model import OnnxModel

        m = OnnxModel((folder / "model.onnx").read_bytes(), 1)
        return float((m.predict(x.astype(np.float32))["label"] == y).mean())
    except Exception:  # noqa: BLE001 - the onnx extra missing, or an unloadable file: no figure
        return None


def collect(states: dict[str, Path], run_ids: list[str], test: Any = None) -> dict[str, Any]:
    """Per agent: each run's training samples, end time and deployment, and the versions.

    Returns ``{"nodes": {id: {"store_samples", "current", "runs": [{"run_id",
    "train_samples", "validation_samples", "rounds", "run_end", "deployed_version",
    "accuracy", "replaced_accuracy", "heldout_accuracy", "deployed_at", "deploy_latency_s",
    "note", "started_from", "first_round_accuracy"}]}},
    "deployments": [...]}``.  ``run_end`` is when the run's last round was recorded,
    ``deployed_at`` when the version's manifest was written (Unix seconds); ``started_from``
    the version the run started from (warm start; None: fresh weights), ``first_round_accuracy``
    its accuracy on the validation slice after round 1.
    """
    from dfl_agent.deploy import ModelStore
    from dfl_agent.runtime.service.retention import read_records

    nodes: dict[str, Any] = {}
    deployments = []
    for nid, state in states.items():
        models = ModelStore(state)
        manifests = {v: models.manifest(v) for v in models.versions()}
        runs = []
        for rid in run_ids:
            recs = read_records(state / "runs" / rid)  # metrics.jsonl, gzipped once the run ended
            mpath = next((p for p in (state / "runs" / rid / n for n in ("metrics.jsonl", "metrics.jsonl.gz"))
                          if p.exists()), state / "runs" / rid / "metrics.jsonl")
            entry: dict[str, Any] = {
                "run_id": rid, "train_samples": recs[0].get("train_samples") if recs else None,
                "validation_samples": recs[0].get("validation_samples") if recs else None,
                "rounds": recs[-1]["round"] if recs else 0,
                "run_end": mpath.stat().st_mtime if recs else None, "deployed_version": None,
                "accuracy": None, "replaced_accuracy": None, "heldout_accuracy": None, "deployed_at": None,
                "deploy_latency_s": None,
                "note": None, "started_from": recs[0].get("started_from") if recs else None,
                "first_round_accuracy": recs[0].get("global_accuracy") if recs else None,
            }
            for v, m in manifests.items():
                if m.get("run_id") == rid:
                    at = (models.folder(v) / "manifest.json").stat().st_mtime
                    entry.update(deployed_version=v, accuracy=m.get("accuracy"), deployed_at=at, note=m.get("note"),
                                 replaced_accuracy=m.get("deployed_accuracy"),
                                 deploy_latency_s=round(at - entry["run_end"], 3) if entry["run_end"] else None)
                    if test is not None:
                        entry["heldout_accuracy"] = _heldout_accuracy(models.folder(v), test.x, test.y)
                    deployments.append({"node": nid, "version": v, "run_id": rid, "accuracy": entry["accuracy"],
                                        "heldout_accuracy": entry["heldout_accuracy"], "time": at,
                                        "run_end": entry["run_end"], "latency_s": entry["deploy_latency_s"]})
            if entry["deployed_version"] is None:
                cand = models.show().get("candidate") or {}
                if cand.get("run_id") == rid:
                    entry["note"] = cand.get("note")
            runs.append(entry)
        nodes[nid] = {"store_samples": _store_count(state), "current": models.current_version(), "runs": runs}
    return {"nodes": nodes, "deployments": sorted(deployments, key=lambda d: d["time"])}


def feed_federation(opts: FeedOptions, on_tick: Any = None) -> dict[str, Any]:
    """Run the feed scenario; returns the summary (also written to ``OUT/summary.json``).

    ``on_tick(statuses, states, feeder, phase)`` is called about twice a second (the live
    view).  Summary: ``{"federation", "nodes": ..., "deployments": ... (see :func:`collect`),
    "runs": [run ids in order], "feed": {"windows_fed", "passes"}, "failed": [...],
    "wall_seconds"}``.

    Raises:
        ValueError: bad options (too many nodes for HAR).
        TimeoutError: a run did not finish on every agent within its budget.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.cli.broker import start_broker
    from dfl_agent.cli.demo import INTERRUPT_GRACE, stop_processes
    from dfl_agent.cli.fleet import publish_retained
    from dfl_agent.cli.observer import Observer
    from dfl_agent.runtime.service.ledger import RunLedger
    from dfl_agent.runtime.shared.descriptor import (
        RunDescriptor,
        new_run_id,
        operator_certificate,
        run_topic,
        sign_descriptor,
    )
    from dfl_agent.security.keys import FEDERATION_KEY_FILE, enroll_local, load_or_create_key, public_key_b64

    started = time.time()
    out = Path(opts.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ids, data, bundle = _users(opts)
    fed = "feed-" + secrets.token_hex(3)
    fed_key = load_or_create_key(out, str(out / FEDERATION_KEY_FILE))
    op_key = Ed25519PrivateKey.generate()
    op_cert = operator_certificate(fed_key, fed, "demo-operator", public_key_b64(op_key))
    states = {nid: out / "nodes" / nid for nid in ids}
    given = {}
    for nid in ids:  # a little data to start with
        x, y = data[nid]
        given[nid] = max(24, int(round(opts.initial * len(y))))
        drop_into_spool(states[nid] / "spool", "initial.npz", x[:given[nid]], y[:given[nid]])
        enroll_local(fed_key, fed, nid, states[nid])
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Any] = {}
    feeder = Feeder({n: states[n] / "spool" for n in ids}, data, given, opts.feed_chunk, opts.feed_interval,
                    out / "feed.jsonl")
    run_ids: list[str] = []
    failed: list[str] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    interrupted = False
    seen: dict[str, Any] = {}  # the agents' last statuses: how far an interrupted demo got
    with start_broker(opts.broker) as broker:
        for nid in ids:
            cfg = _config(opts, fed, nid, states[nid], broker.endpoint, bundle.pool, public_key_b64(fed_key))
            path = states[nid] / "node.toml"
            path.write_text(dump_toml(cfg), encoding="utf-8")
            logs[nid] = open(out / "logs" / f"{nid}.log", "w", encoding="utf-8")
            procs[nid] = subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config",
                                           str(path)], stdout=logs[nid], stderr=subprocess.STDOUT, env=env)
        observer = Observer(broker.endpoint, fed).start()
        feeder.start()
        budget = opts.start_timeout + opts.rounds * (opts.round_timeout + 120)

        def wait(cond: Any, what: str, timeout: float, phase: str) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if on_tick is not None:
                    on_tick(observer.snapshot()[0], states, feeder, phase)
                if cond():
                    return
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"agent(s) {', '.join(dead)} exited (see {out}/logs)")
                time.sleep(0.5)
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (see {out}/logs)")

        def training_in_new_run() -> bool:  # every agent took run k's snapshot (its run status is up)
            st = observer.snapshot()[0]
            return all(st.get(n, {}).get("global_accuracy_source") and (st[n].get("run") or {}).get("id")
                       and st[n]["run"]["id"] not in run_ids for n in ids)

        def all_fed_ingested() -> bool:
            return feeder.pending() == 0 and all(_store_count(states[n]) >= feeder.pos[n] for n in ids)

        try:
            for k in range(1, opts.runs + 1):
                if k > 1:
                    # the next run starts once what was fed during the last one is in every store
                    wait(all_fed_ingested, "the stores to take the fed windows",
                         120 + opts.feed_interval * (1 + max(len(data[n][1]) for n in ids) / opts.feed_chunk),
                         f"feeding before run {k}")
                    now = time.time()
                    d = RunDescriptor.from_dict({
                        "run_id": new_run_id(fed, opts.algorithm, now, secrets.token_hex(4)), "federation": fed,
                        "algorithm": opts.algorithm, "rounds": opts.rounds, "name": f"feed run {k}",
                        "options": {"round_timeout": opts.round_timeout} if opts.algorithm == "fedavg" else {},
                        "model": {"size": opts.model_size}, "training": {}, "members": "all",
                        "min_members": opts.nodes, "start_timeout": opts.start_timeout, "submitter": "demo-operator",
                        "submitted_at": now, "seq": 1,
                    })
                    publish_retained(broker.endpoint, run_topic(fed, d.run_id),
                                     sign_descriptor(d, op_key, "demo-operator", op_cert))
                wait(lambda k=k: training_in_new_run() or all(len(_terminal_runs(states[n])) >= k for n in ids),
                     f"run {k} to start on every agent", budget, f"run {k}")
                for n in ids:  # windows arrive while run k trains: this run's share of the rest
                    total, first = len(data[n][1]), given[n]
                    feeder.limit[n] = first + -(-k * (total - first) // max(1, opts.runs - 1))
                wait(lambda k=k: all(len(_terminal_runs(states[n])) >= k for n in ids), f"run {k} on every agent",
                     budget, f"run {k}")
                done = _terminal_runs(states[ids[0]])
                run_ids.append(done[k - 1])
            for n in ids:
                for rid in run_ids:
                    if RunLedger(states[n]).state(rid) != "finished":
                        failed.append(n)
                        break
        except KeyboardInterrupt:  # Ctrl-C: stop the agents at once, then report what was done
            interrupted = True
        finally:
            feeder.stop()
            seen = observer.snapshot()[0]
            stop_processes(procs.values(), timeout=INTERRUPT_GRACE if interrupted else 30)
            observer.stop()
            for f in logs.values():
                f.close()
    summary = {"federation": fed, "algorithm": opts.algorithm, "rounds": opts.rounds, "runs": run_ids,
               **collect(states, run_ids, bundle.test),
               "feed": {"windows_fed": {n: feeder.pos[n] for n in ids}, "initial": given, "passes": feeder.passes,
                        "interval_s": opts.feed_interval, "chunk": opts.feed_chunk},
               "failed": sorted(set(failed)), "started": started, "wall_seconds": round(time.time() - started, 1),
               # interrupted (Ctrl-C): an incomplete report; the run and round each agent last reported
               "complete": not interrupted, "interrupted": interrupted,
               "reported": {n: {"run": (seen.get(n, {}).get("run") or {}).get("id"),
                                "round": int(seen.get(n, {}).get("round") or 0)} for n in ids}}
    from dfl_agent.runtime.node.metrics import atomic_write_text

    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=float) + "\n")
    if interrupted:
        raise KeyboardInterrupt
    return summary


def _live_table(statuses: dict[str, Any], states: dict[str, Path], feeder: Feeder, phase: str) -> Any:
    from rich.table import Table

    from dfl_agent.deploy import ModelStore

    t = Table(title=f"dfl-agent demo --feed: {phase}; feeder pass {feeder.passes}, "
                    f"{feeder.remaining()} windows still to come")
    for col in ("node", "state", "run", "round", "samples in store", "deployed", "validation accuracy"):
        t.add_column(col, justify="left" if col in ("node", "state", "run") else "right")
    for nid, state in states.items():
        s = statuses.get(nid, {})
        run = s.get("run") or {}
        models = ModelStore(state)
        cur = models.current_version()
        acc = models.manifest(cur).get("accuracy") if cur is not None else None
        t.add_row(nid, str(s.get("state", "starting")), str(run.get("id", "-"))[:24], str(s.get("round", 0)),
                  str(_store_count(state)), f"v{cur}" if cur else "-",
                  f"{acc:.3f}" if isinstance(acc, (int, float)) else "-")
    return t


def final_table(summary: dict[str, Any]) -> Any:
    """The rich table of deployed versions: per agent and run, samples trained on, version
    deployed, its validation accuracy and its accuracy on the held-out users."""
    from rich.table import Table

    t = Table(title="final: deployed models. Accuracy on the agent's validation slice when it deployed "
                    "(in brackets: the version it replaced, on the same slice); held-out: the HAR test users")
    t.add_column("node")
    t.add_column("samples in store", justify="right")
    for k in range(1, len(summary["runs"]) + 1):
        t.add_column(f"run {k}", justify="right")
    t.add_column("current", justify="right")
    for nid, n in summary["nodes"].items():
        cells = []
        for r in n["runs"]:
            lines = [f"trained on {r['train_samples']}"]
            if r["deployed_version"] is not None:
                old = r.get("replaced_accuracy")
                lines.append(f"v{r['deployed_version']} acc {r['accuracy']:.3f}"
                             + (f" ({old:.3f})" if isinstance(old, (int, float)) else ""))
                if r.get("started_from") is not None:
                    lines.append(f"started from v{r['started_from']}")
                if r["heldout_accuracy"] is not None:
                    lines.append(f"held-out {r['heldout_accuracy']:.3f}")
            else:
                lines.append("not deployed (gate)")
            cells.append("\n".join(lines))
        t.add_row(nid, str(n["store_samples"]), *cells, f"v{n['current']}" if n["current"] else "-")
    return t


def run_feed_demo(opts: FeedOptions) -> int:
    """``dflctl demo --feed``; returns the exit code (0: every agent finished every run)."""
    from rich.console import Console
    from rich.live import Live

    from dfl_agent.cli.demo import _Null

    console = Console()
    live = sys.stdout.isatty() if opts.live is None else opts.live
    last: dict[str, Any] = {}

    with Live(console=console, refresh_per_second=2, transient=False) if live else _Null() as view:
        def tick(statuses: dict[str, Any], states: dict[str, Path], feeder: Feeder, phase: str) -> None:
            if live:
                view.update(_live_table(statuses, states, feeder, phase))
            elif last.get("phase") != phase:
                last["phase"] = phase
                console.print(f"{phase} (feeder pass {feeder.passes}, {feeder.remaining()} windows still to come)")

        console.print(f"{opts.nodes} agents on their sample stores, {opts.runs} runs of {opts.algorithm} x "
                      f"{opts.rounds} rounds; report folder {opts.out}")
        try:
            summary = feed_federation(opts, tick)
        except (TimeoutError, RuntimeError) as exc:
            console.print(f"[bold red]{exc}[/]")
            return 1
        except KeyboardInterrupt:  # the agents are stopped and summary.json is written, marked incomplete
            path = Path(opts.out) / "summary.json"
            if path.exists():
                summary = json.loads(path.read_text())
                if summary.get("interrupted"):
                    console.print(final_table(summary))
                    got = ", ".join(f"{n} run {r['run'] or '-'} round {r['round']}"
                                    for n, r in summary["reported"].items())
                    console.print(f"partial report (incomplete: interrupted): {path}; reached: {got}")
            raise
    console.print(final_table(summary))
    if summary["failed"]:
        console.print(f"[bold red]not every run finished on {', '.join(summary['failed'])} "
                      f"(see {opts.out}/logs)[/]")
        return 1
    console.print(f"report: {opts.out}/summary.json, {opts.out}/feed.jsonl, {opts.out}/logs")
    return 0
