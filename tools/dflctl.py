"""``dflctl``: the dfl-agent command line.

Commands:
  demo       run a real federation of agent processes on this machine (the main job)
  simulate   run N nodes of an algorithm in one process (paper reproductions, tests)
  peers      list a federation's nodes from their retained MQTT presence
  status     show a federation's (or one node's) retained status documents
  algorithms list the registered algorithms
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent import __version__
from agent.models.families import FAMILIES


def _kv(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"dflctl: --option must be KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _model_specs(value: str | None) -> list[dict[str, Any]] | None:
    """``--models``: a JSON list of model specs (one per node, cycled) or a JSON file."""
    if not value:
        return None
    text = open(value, encoding="utf-8").read() if not value.lstrip().startswith("[") else value
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--models must be a JSON list of model specs or a file holding one: {exc}") from None
    if not isinstance(specs, list) or not specs or not all(isinstance(x, dict) for x in specs):
        raise ValueError("--models must be a non-empty JSON list of model spec objects")
    return specs


def cmd_simulate(a: argparse.Namespace) -> int:
    from agent.learning.training import TrainConfig
    from agent.runtime.simulator import SimConfig, simulate

    cfg = SimConfig(
        algorithm=a.algorithm, nodes=a.nodes, rounds=a.rounds, dataset=a.dataset, dataset_path=a.dataset_path,
        partition=a.partition, beta=a.beta, zeta=a.zeta, seed=a.seed, out=a.out, options=_kv(a.option),
        train=TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, momentum=a.momentum),
        model_size=a.model_size,
        init=a.init, baseline_local=a.baseline_local, topology=a.topology,
        topology_options=_kv(a.topology_option),
        model_family=a.models if a.models in FAMILIES else None, eval_every=a.eval_every,
        model_specs=None if a.models in FAMILIES else _model_specs(a.models),
        compression=a.compression, error_feedback=a.error_feedback,
    )
    s = simulate(cfg)
    g, lo = s["global_accuracy"], s["local_accuracy"]
    print(
        f"{s['algorithm']}: {s['nodes']} nodes, {s['rounds_completed']} rounds on {a.dataset}/{a.partition} in "
        f"{s['wall_seconds']:.1f}s; global accuracy {g['mean']:.4f} ± {g['std']:.4f}, "
        f"local accuracy {lo['mean']:.4f} ± {lo['std']:.4f}; {s['bytes_sent'] / 1e6:.1f} MB sent"
    )
    if s.get("compression", "none") != "none":
        print(f"compression {s['compression']}: {s['compression_ratio']:.1f}x fewer bytes than float32")
    if "local_only_global_accuracy" in s:
        print(f"local-only baseline: global accuracy {s['local_only_global_accuracy']['mean']:.4f}")
    if a.out:
        print(f"report: {a.out}/summary.json")
    return 0


def _compression_args(p: argparse.ArgumentParser) -> None:
    """``--compression SPEC`` and ``--no-error-feedback`` (issue 8)."""

    def spec(text: str) -> str:
        from agent.learning.compression import CompressionError, parse_spec

        try:
            return str(parse_spec(text))
        except CompressionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--compression", default="none", type=spec, metavar="SPEC",
                   help="none, fp16, bf16, q8, q4, q2, topk:0.01+q8, randk:0.1+q8, ...+zstd (see README)")
    p.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="no residuals / CHOCO copies for sparsified streams (to compare)")


def cmd_demo(a: argparse.Namespace) -> int:
    from tools.demo import DemoOptions, run_demo

    return run_demo(DemoOptions(
        nodes=a.nodes, rounds=a.rounds, algorithm=a.algorithm, models=a.models, out=a.out, broker=a.broker, seed=a.seed,
        epochs=a.epochs, round_timeout=a.round_timeout, kill=a.kill, live=a.live, protocol=a.protocol,
        compression=a.compression, error_feedback=a.error_feedback,
    ))


def _observe(a: argparse.Namespace):
    from tools.observer import Observer

    broker, fed = a.broker, a.federation
    if a.config:
        from agent.runtime.config import load_config

        cfg = load_config(a.config)
        broker, fed = broker or cfg.mqtt.broker, fed or cfg.federation
    obs = Observer(broker or "127.0.0.1:1883", fed or "default").start(timeout=a.timeout)
    obs.settle()
    statuses, presence = obs.snapshot()
    obs.stop()
    return statuses, presence


def cmd_peers(a: argparse.Namespace) -> int:
    statuses, presence = _observe(a)
    rows = []
    for nid in sorted(set(presence) | set(statuses)):
        p, s = presence.get(nid, {}), statuses.get(nid, {})
        d = p.get("descriptor", {}) or {}
        rows.append({
            "node_id": nid, "state": p.get("state", "unknown"), "broker": d.get("broker", ""),
            "profile": d.get("profile", ""), "algorithm": d.get("algorithm", ""), "model": d.get("model_hash", ""),
            "version": d.get("version", ""), "round": s.get("round"),
            "last_seen_s": round(time.time() - float(s.get("time", p.get("time", 0)) or 0), 1),
        })
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="peers")
    for col in ("node_id", "state", "broker", "profile", "algorithm", "model", "round", "last_seen_s"):
        t.add_column(col)
    for r in rows:
        t.add_row(*(str(r[c]) for c in ("node_id", "state", "broker", "profile", "algorithm", "model", "round", "last_seen_s")))
    Console().print(t)
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    statuses, _ = _observe(a)
    if a.node:
        if a.node not in statuses:
            print(f"dflctl: no status for node {a.node!r}", file=sys.stderr)
            return 1
        statuses = {a.node: statuses[a.node]}
    print(json.dumps(statuses, indent=2, sort_keys=True))
    return 0


def cmd_algorithms(a: argparse.Namespace) -> int:
    from agent.algorithms.base import available

    print("\n".join(available()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dflctl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("simulate", help="N nodes in one process over the memory transport")
    s.add_argument("--algorithm", default="fedavg")
    s.add_argument("--nodes", type=int, default=10)
    s.add_argument("--rounds", type=int, default=20)
    s.add_argument("--dataset", default="har", choices=["har", "digits", "idx", "npz"])
    s.add_argument("--dataset-path", default=None, help="directory for --dataset idx|npz")
    s.add_argument("--partition", default="by-user", choices=["iid", "dirichlet", "shards", "by-user"])
    s.add_argument("--beta", type=float, default=0.5, help="Dirichlet concentration (label skew)")
    s.add_argument("--zeta", type=int, default=2, help="shards (classes) per node")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--lr", type=float, default=0.05)
    s.add_argument("--momentum", type=float, default=0.9)
    s.add_argument("--model-size", default="medium", choices=["small", "medium", "large"])
    s.add_argument("--init", default="common", choices=["common", "independent"])
    s.add_argument("--baseline-local", action="store_true", help="also train a local-only copy per node")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="algorithm option (repeatable)")
    s.add_argument("--eval-every", type=int, default=1, help="evaluate every N rounds (and the last)")
    s.add_argument("--topology", default="full", help="communication graph (full, ring, ...)")
    s.add_argument("--topology-option", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--models", default=None,
                   help="H0, H1 or H2 (DFML's architecture modes, spread over nodes), or per-node model specs: "
                        "a JSON list (cycled over nodes) or a file holding one")
    s.add_argument("--out", default=None, help="report folder (summary.json, metrics.jsonl, accuracy.png)")
    _compression_args(s)
    s.set_defaults(func=cmd_simulate)

    d = sub.add_parser("demo", help="real agent processes + MQTT broker + mDNS on 127.0.0.1, HAR data")
    d.add_argument("--nodes", type=int, default=5)
    d.add_argument("--rounds", type=int, default=20)
    d.add_argument("--algorithm", default="dfml")
    d.add_argument("--models", default=None, choices=sorted(FAMILIES),
                   help="architecture mode per agent (default H2 for dfml/dfedavg/dfedprox: 5 different CNNs)")
    d.add_argument("--out", default="dfl-demo")
    d.add_argument("--broker", default="auto", choices=["auto", "mosquitto", "amqtt"])
    d.add_argument("--protocol", default="5", choices=["5", "3.1.1"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--epochs", type=int, default=1)
    d.add_argument("--round-timeout", type=float, default=30.0, help="seconds a round waits for peers")
    d.add_argument("--kill", default=None, metavar="INDEX@ROUND", help="SIGKILL agent INDEX after its round ROUND")
    d.add_argument("--live", dest="live", action="store_true", default=None, help="live table (default on a terminal)")
    d.add_argument("--no-live", dest="live", action="store_false")
    _compression_args(d)
    d.set_defaults(func=cmd_demo)

    for name, fn, helptext in (("peers", cmd_peers, "list nodes from retained presence"),
                               ("status", cmd_status, "retained status documents")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--broker", default=None, help="host:port (default: from --config, else 127.0.0.1:1883)")
        c.add_argument("--federation", default=None)
        c.add_argument("--config", default=None, help="read broker and federation from a node config")
        c.add_argument("--timeout", type=float, default=5.0)
        if name == "status":
            c.add_argument("node", nargs="?", default=None)
        else:
            c.add_argument("--json", action="store_true")
        c.set_defaults(func=fn)

    al = sub.add_parser("algorithms", help="list registered algorithms")
    al.set_defaults(func=cmd_algorithms)
    _register_extensions(sub)
    return p


def _register_extensions(sub: Any) -> None:
    """Add the commands of every ``tools/cli_*.py`` module.

    Each such module defines ``register(sub)``, which adds its sub-commands to the
    ``dflctl`` sub-parser collection ``sub`` (an ``argparse`` ``_SubParsersAction``)
    and sets ``func`` on each, as the built-in commands above do. Modules are loaded
    in name order; an ``ImportError`` in one (an optional dependency missing) hides
    only its commands.
    """
    import importlib
    import pkgutil

    import tools

    for mod in sorted(m.name for m in pkgutil.iter_modules(tools.__path__) if m.name.startswith("cli_")):
        try:
            module = importlib.import_module(f"tools.{mod}")
        except ImportError as exc:  # pragma: no cover - depends on installed extras
            print(f"dflctl: commands of tools.{mod} unavailable: {exc}", file=sys.stderr)
            continue
        module.register(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dflctl`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError, ConnectionError, ImportError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"dflctl: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
