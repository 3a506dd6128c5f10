"""``dflctl demo``: a real federation of agent processes on this machine.

Starts an MQTT broker on a free loopback port (mosquitto when installed, otherwise
amqtt), writes one configuration per node, starts N ``dfl-agent`` processes (each
holds one HAR user's recordings; they find each other by mDNS on 127.0.0.1), shows
their progress live from the retained status topics, and finally writes the report
folder: ``metrics.jsonl``, ``summary.json``, ``accuracy.png``, per-node logs.

Exit code 0 when every agent that was not deliberately killed finished all rounds.
Ctrl-C (SIGINT) stops every agent within :data:`INTERRUPT_GRACE` seconds (SIGTERM to all at
once, SIGKILL after the grace), still writes the report with what was done, marked
``"complete": false, "interrupted": true`` in ``summary.json`` (``rounds_reported`` says how
far each node got: the last round its status reported), and ends with ``KeyboardInterrupt`` (``dflctl`` exits 130).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dfl_agent.algorithms.protocols.stragglers import REPRODUCTION_MODE
from dfl_agent.runtime.node import metrics
from dfl_agent.runtime.shared.config import (
    AlgorithmSection,
    CompressionSection,
    DataSection,
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
class DemoOptions:
    """Arguments of ``dflctl demo`` (see ``dflctl demo --help``)."""

    nodes: int = 5
    rounds: int = 20
    algorithm: str = "dfml"
    models: str | None = None  # H0/H1/H2; default H2 for the rotating-aggregator algorithms
    out: str = "dfl-demo"
    broker: str = "auto"
    dataset: str = "har"
    seed: int = 0
    epochs: int = 1
    round_timeout: float = 30.0
    start_timeout: float = 90.0
    kill: str | None = None  # "INDEX@ROUND"
    live: bool | None = None  # None = when stdout is a terminal
    protocol: str = "5"
    profiles: str | None = None  # comma-separated device profiles, one per agent (cycled)
    compression: str = "none"  # spec of every agent (issue 8)
    error_feedback: bool = True
    straggler: str = REPRODUCTION_MODE  # runtime.straggler of every agent


#: seconds the agents get to leave cleanly after Ctrl-C before they are killed
INTERRUPT_GRACE = 3.0


def stop_processes(procs: Any, timeout: float = 15.0) -> None:
    """SIGTERM every still-running ``subprocess.Popen`` in ``procs`` at once, wait up to
    ``timeout`` s in all for them to leave the federation cleanly, then SIGKILL what is left
    (and reap it)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _node_ids(opts: DemoOptions) -> list[str]:
    if opts.dataset == "har":
        from dfl_agent.data import load_dataset

        users = sorted({int(u) for u in load_dataset("har").pool.groups})
        if opts.nodes > len(users):
            raise ValueError(f"--nodes {opts.nodes}: HAR has only {len(users)} users outside the test group")
        return [f"user{u:02d}" for u in users[: opts.nodes]]
    return [f"node{i:02d}" for i in range(opts.nodes)]


def _rotating_tier_mix(algorithm: str) -> bool:
    """Whether ``algorithm`` is a rotating aggregator whose members train models of
    different architectures of the size-tier family (DFML, DFedAvg, DFedProx; read from
    the algorithm's traits): the demo gives such agents the H2 family by default and maps
    ``--round-timeout`` onto their token deadlines.  False for an unknown name."""
    from dfl_agent.algorithms.base import traits_of

    try:
        t = traits_of(algorithm)
    except KeyError:
        return False
    return t.family == "rotating" and t.mixes_architectures and t.default_model == "tier"


def _algorithm_options(opts: DemoOptions) -> dict[str, Any]:
    """Map ``--round-timeout`` onto each algorithm's deadlines."""
    t = opts.round_timeout
    if opts.algorithm == "fedavg":
        return {"round_timeout": t}
    if _rotating_tier_mix(opts.algorithm):
        return {"invite_timeout": t, "update_timeout": 4 * t, "token_timeout": 2 * t}
    return {}


def _profiles(opts: DemoOptions) -> list[str]:
    """``--profiles a,b,c`` (validated), or none."""
    names = [p.strip() for p in (opts.profiles or "").split(",") if p.strip()]
    if names:
        from dfl_agent.profiles import get_profile

        for n in names:
            get_profile(n)  # ProfileError (a ValueError) names an unknown one
    return names


def _model_specs(opts: DemoOptions) -> list[dict[str, Any]] | None:
    if opts.profiles and not opts.models:
        return None  # each agent's model comes from its profile (decision table)
    family = opts.models or ("H2" if _rotating_tier_mix(opts.algorithm) else None)
    if family is None:
        return None
    from dfl_agent.data import load_dataset
    from dfl_agent.models.families import family_specs

    pool = load_dataset(opts.dataset).pool
    return family_specs(family, pool.input_shape, pool.num_classes)


def _config(opts: DemoOptions, fed: str, nid: str, index: int, broker: str, out: Path,
            specs: list[dict[str, Any]] | None = None, federation_key: str | None = None) -> NodeConfig:
    node_dir = out / "nodes" / nid
    return NodeConfig(
        security=SecuritySection(require_signatures=federation_key is not None, federation_key=federation_key),
        federation=fed, node_id=nid, state_dir=str(node_dir), seed=opts.seed,
        profile=(_profiles(opts) or ["generic-x86"])[index % len(_profiles(opts) or ["generic-x86"])],
        # every agent shares this one machine: its load and the clock would gate them all
        profile_overrides={"limits": {"max_load_per_core": 0}, "training": {"windows": []}},
        algorithm=AlgorithmSection(name=opts.algorithm, rounds=opts.rounds, options=_algorithm_options(opts)),
        model=ModelSection(spec=specs[index % len(specs)] if specs else None),
        training=TrainingSection(epochs=opts.epochs, threads=1),
        data=DataSection(dataset=opts.dataset, partition="by-user" if opts.dataset == "har" else "iid",
                         num_nodes=opts.nodes, node_index=index),
        mqtt=MqttSection(broker=broker, protocol=opts.protocol),
        discovery=DiscoverySection(mdns=True, interfaces=["127.0.0.1"], min_peers=opts.nodes - 1,
                                   start_timeout=opts.start_timeout, heartbeat_timeout=30.0),
        runtime=RuntimeSection(baseline_local=True, metrics_file=str(node_dir / "metrics.jsonl"),
                               straggler=opts.straggler),
        compression=CompressionSection(spec=opts.compression, error_feedback=opts.error_feedback),
    )


#: what the accuracy columns show when the algorithm keeps a peak model besides its regular one (DFML)
PEAK_NOTE = ("peak: the deployed model, replaced only when α reaches a new maximum (flat in between); "
             "regular: the model trained every round; took part: the node was in the round's group "
             "(other rounds leave its models unchanged)")


def _two_models(docs: Any) -> bool:
    """Whether the algorithm evaluates a regular model besides the deployed (peak) one."""
    return any(isinstance(d, dict) and "regular_global_accuracy" in d for d in docs)


def _took_part(doc: dict[str, Any]) -> str:
    p = doc.get("participated")
    return "yes" if p is True else "no" if p is False else "-"


def _num(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


#: the live table's columns that go first when the terminal is too narrow for all of them,
#: least important first (node, round, the accuracy columns and "alone" always stay)
DROP_FIRST = ("recv MB", "sent MB", "dropped", "peers", "took part", "state")


def _fit(columns: list[str], rows: list[list[str]], width: int | None) -> list[str]:
    """The columns to show in ``width`` terminal columns: all of them when they fit, else
    without the :data:`DROP_FIRST` ones, in that order, until they fit (never truncated)."""
    if width is None:
        return columns
    keep = list(columns)

    def needed() -> int:  # rich's default box: a border before each column and after the last, padding 1+1
        return 1 + sum(3 + max([len(c)] + [len(r[columns.index(c)]) for r in rows]) for c in keep)

    for col in DROP_FIRST:
        if needed() <= width:
            break
        if col in keep:
            keep.remove(col)
    return keep


def _table(statuses: dict[str, dict[str, Any]], presence: dict[str, dict[str, Any]], ids: list[str], rounds: int,
           width: int | None = None):
    """The live table; ``width`` (the terminal's columns): less important columns are left
    out (:data:`DROP_FIRST`) rather than truncating any."""
    from rich.table import Table

    two = _two_models(statuses.values())
    accuracy_cols = ("peak", "regular", "took part") if two else ("federated",)
    columns = ["node", "state", "round", *accuracy_cols, "alone", "peers", "sent MB", "recv MB", "dropped"]
    rows = []
    for nid in ids:
        s = statuses.get(nid, {})
        online = presence.get(nid, {}).get("state", "-")
        state = s.get("state", "starting") if online != "offline" else "offline"
        acc = [_num(s.get("global_accuracy"))]
        if two:
            acc += [_num(s.get("regular_global_accuracy")), _took_part(s)]
        rows.append([
            nid, state, f"{s.get('round', 0)}/{rounds}", *acc,
            _num(s.get("local_only_global_accuracy")),
            str(len(s.get("live_peers", []) or [])),
            f"{s.get('bytes_sent', 0) / 1e6:.2f}", f"{s.get('bytes_received', 0) / 1e6:.2f}",
            str(sum((s.get("errors") or {}).values())),
        ])
    shown = _fit(columns, rows, width)
    t = Table(title=f"dfl-agent demo: {len(ids)} agents, {rounds} rounds (global test accuracy, held-out users)",
              caption=PEAK_NOTE if two else None, caption_justify="left")
    for col in shown:
        t.add_column(col, justify="right" if col not in ("node", "state") else "left", no_wrap=True)
    for row in rows:
        t.add_row(*(row[columns.index(c)] for c in shown))
    return t


def progress_line(nid: str, s: dict[str, Any], rounds: int) -> str:
    """One line of the demo's progress without a live table (a node's newest round)."""
    if "regular_global_accuracy" in s:
        took = {True: "took part", False: "did not take part"}.get(s.get("participated"), "")
        acc = (f"peak (deployed) {_num(s.get('global_accuracy'))}, regular {_num(s.get('regular_global_accuracy'))}"
               + (f", {took}" if took else ""))
    else:
        acc = f"federated {_num(s.get('global_accuracy'))}"
    return (f"{nid} round {s.get('round', 0)}/{rounds}: {acc}, alone {_num(s.get('local_only_global_accuracy'))}, "
            f"peers {len(s.get('live_peers') or [])}")


def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns the process exit code (0 = the federation succeeded)."""
    from rich.live import Live

    from dfl_agent.cli.broker import start_broker
    from dfl_agent.cli.observer import Observer
    from dfl_agent.cli.output import console as make_console

    console = make_console()  # no wrapping when stdout is not a terminal
    started = time.time()
    out = Path(opts.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    kill_index, kill_round = None, None
    if opts.kill:
        try:
            a, b = opts.kill.split("@")
            kill_index, kill_round = int(a), int(b)
        except ValueError:
            raise ValueError(f"--kill must be INDEX@ROUND, got {opts.kill!r}") from None
        if not 0 <= kill_index < opts.nodes:
            raise ValueError(f"--kill index must be in [0, {opts.nodes})")
    ids = _node_ids(opts)
    profiles = _profiles(opts)
    specs = _model_specs(opts)
    fed = "demo-" + secrets.token_hex(3)
    live = sys.stdout.isatty() if opts.live is None else opts.live

    with start_broker(opts.broker) as broker:
        console.print(f"broker: {broker.kind} on {broker.endpoint}; federation {fed}; {opts.algorithm}; "
                      f"report folder {out}")
        if profiles:
            console.print("profiles: " + ", ".join(f"{nid}={profiles[i % len(profiles)]}" for i, nid in enumerate(ids)))
        if specs:
            console.print("models: " + ", ".join(
                f"{nid}={s.get('channels') or s.get('widths') or s.get('hidden')}" for nid, s in
                zip(ids, [specs[i % len(specs)] for i in range(len(ids))])))
        procs: dict[str, subprocess.Popen] = {}
        logs = {}
        killed: set[str] = set()
        observer = None
        interrupted = False
        seen_rounds: dict[str, int] = {}  # the last round each agent's status reported
        try:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            fed_pub = _enroll(out, fed, ids)
            for i, nid in enumerate(ids):
                cfg = _config(opts, fed, nid, i, broker.endpoint, out.resolve(), specs, fed_pub)
                path = out / "nodes" / nid / "node.toml"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(dump_toml(cfg), encoding="utf-8")
                logs[nid] = open(out / "logs" / f"{nid}.log", "w", encoding="utf-8")
                procs[nid] = subprocess.Popen(
                    [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(path)],
                    stdout=logs[nid], stderr=subprocess.STDOUT, env=env,
                )
            observer = Observer(broker.endpoint, fed, protocol=opts.protocol).start()
            budget = opts.start_timeout + 60 + opts.rounds * (opts.round_timeout + 60)
            deadline = time.monotonic() + budget
            last_print: dict[str, int] = {}
            with Live(console=console, refresh_per_second=2, transient=False) if live else _Null() as view:
                while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
                    statuses, presence = observer.snapshot()
                    seen_rounds.update({n: int(s.get("round") or 0) for n, s in statuses.items() if n in procs})
                    if kill_index is not None and ids[kill_index] not in killed:
                        victim = ids[kill_index]
                        if statuses.get(victim, {}).get("round", 0) >= kill_round:
                            procs[victim].send_signal(signal.SIGKILL)
                            killed.add(victim)
                            console.print(f"[bold red]killed {victim} (SIGKILL) after its round {kill_round}[/]")
                    if live:
                        view.update(_table(statuses, presence, ids, opts.rounds, width=console.width))
                    else:
                        for nid, s in sorted(statuses.items()):
                            r = s.get("round", 0)
                            if r and last_print.get(nid) != r:
                                last_print[nid] = r
                                console.print(progress_line(nid, s, opts.rounds))
                    time.sleep(0.5)
        except KeyboardInterrupt:  # Ctrl-C: stop the agents at once, then report what was done
            interrupted = True
        finally:
            timed_out = [] if interrupted else [n for n, p in procs.items() if p.poll() is None]
            stop_processes(procs.values(), timeout=INTERRUPT_GRACE if interrupted else 15.0)
            if observer is not None:
                observer.stop()
            for f in logs.values():
                f.close()
        if interrupted:
            console.print(f"[bold yellow]interrupted: agents stopped; writing the partial report to {out}[/]")

    histories = {}
    for nid in ids:
        mpath = out / "nodes" / nid / "metrics.jsonl"
        histories[nid] = metrics.read_jsonl(mpath) if mpath.exists() else []
    records = [r for nid in ids for r in histories[nid]]
    metrics.write_jsonl(out / "metrics.jsonl", records)
    exit_codes = {nid: procs[nid].returncode if nid in procs else None for nid in ids}
    survivors = [n for n in ids if n not in killed]
    failed = [
        n for n in survivors
        if exit_codes[n] != 0 or not histories[n] or histories[n][-1]["round"] < opts.rounds or n in timed_out
    ]
    # accuracy over the nodes that were meant to finish; bytes over everyone
    summary = metrics.summarize(
        opts.algorithm, {n: histories[n] for n in survivors}, wall_seconds=time.time() - started,
        bytes_by_node={n: (h[-1]["bytes_sent"], h[-1]["bytes_received"]) for n, h in histories.items() if h},
        extra={
            # interrupted (Ctrl-C): an incomplete report; how far each node got (its status or its records)
            "complete": not interrupted, "interrupted": interrupted,
            "rounds_reported": {n: max(seen_rounds.get(n, 0), histories[n][-1]["round"] if histories[n] else 0)
                                for n in ids},
            "dataset": opts.dataset, "partition": "by-user", "federation": fed, "broker": broker.kind,
            "killed": sorted(killed), "failed": failed, "nodes_started": len(ids), "exit_codes": exit_codes,
            "max_round_seconds": max((r["round_seconds"] for r in records), default=0.0),
            "round_timeout": opts.round_timeout,
            "model_specs": {nid: specs[i % len(specs)] for i, nid in enumerate(ids)} if specs else None,
            "profiles": {nid: profiles[i % len(profiles)] for i, nid in enumerate(ids)} if profiles else None,
        },
    )
    metrics.atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=float) + "\n")
    plotted = False
    if records and not interrupted:
        plotted = metrics.plot_accuracy(histories, out / "accuracy.png",
                              title=f"{opts.algorithm}: {len(ids)} agents on HAR (dashed: same model trained alone)")
    _final_table(console, summary, histories, ids, killed)
    if interrupted:
        done = ", ".join(f"{n} {r}/{opts.rounds}" for n, r in summary["rounds_reported"].items())
        console.print(f"partial report (incomplete: interrupted): {out}/summary.json; rounds done: {done}")
        raise KeyboardInterrupt
    if failed:
        console.print(f"[bold red]federation failed: {', '.join(failed)} did not finish (see {out}/logs)[/]")
        return 1
    console.print(f"report: {out}/summary.json, {out}/metrics.jsonl" + (f", {out}/accuracy.png" if plotted else ""))
    return 0


def _enroll(out: Path, fed: str, ids: list[str]) -> str:
    """Signed demo: a federation key in the report folder, every agent enrolled (its key
    created in its state directory, its certificate next to it). Returns the public key."""
    from dfl_agent.security.keys import FEDERATION_KEY_FILE, enroll_local, load_or_create_key, public_key_b64

    fed_key = load_or_create_key(out, str(out / FEDERATION_KEY_FILE))
    for nid in ids:
        enroll_local(fed_key, fed, nid, out / "nodes" / nid)
    return public_key_b64(fed_key)


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *a: object) -> None:
        return None


def _final_table(console, summary, histories, ids, killed) -> None:
    from rich.table import Table

    two = _two_models(r for h in histories.values() for r in h)
    t = Table(title="final: global test accuracy on the held-out users", caption=PEAK_NOTE if two else None,
              caption_justify="left")
    model_cols = ("peak model", "regular model", "took part") if two else ("federated model",)
    for col in ("node", "rounds", *model_cols, "same model trained alone", "sent MB", "received MB"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for nid in ids:
        h = histories[nid]
        if not h:
            t.add_row(nid, "0", *(["-"] * len(model_cols)), "-", "-", "-")
            continue
        evaluated = [r for r in h if "global_accuracy" in r]
        last, last_eval = h[-1], (evaluated[-1] if evaluated else {})
        models = [_num(last_eval.get("global_accuracy"))]
        if two:
            models += [_num(last_eval.get("regular_global_accuracy")),
                       f"{sum(1 for r in h if r.get('participated') is True)}/{len(h)}"]
        t.add_row(
            nid + (" (killed)" if nid in killed else ""), str(last["round"]), *models,
            _num(last_eval.get("local_only_global_accuracy", float("nan"))),
            f"{last['bytes_sent'] / 1e6:.2f}", f"{last['bytes_received'] / 1e6:.2f}",
        )
    g = summary["global_accuracy"]
    lo = summary.get("local_only_global_accuracy", {"mean": float("nan")})
    extra = [_num(summary.get("regular_global_accuracy", {}).get("mean")), ""] if two else []
    t.add_row("mean", str(summary["rounds_completed"]), f"{g['mean']:.3f}", *extra, f"{lo['mean']:.3f}",
              f"{summary['bytes_sent'] / 1e6:.2f}", f"{summary['bytes_received'] / 1e6:.2f}")
    console.print(t)
    console.print(
        f"{'peak (deployed)' if two else 'federated'} {100 * g['mean']:.1f}% vs alone {100 * lo['mean']:.1f}%: "
        f"{100 * (g['mean'] - lo['mean']):+.1f} points; longest round {summary['max_round_seconds']:.1f}s"
    )
