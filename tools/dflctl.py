"""``dflctl``: the dfl-agent command line.

Every command is listed below; ``dflctl COMMAND --help`` shows its options.
Exit codes: 0 ok, 1 a failed check, 2 usage or configuration error, 3 broker unreachable.
"""

from __future__ import annotations

from dfl_agent.interrupt import during_startup, end_startup

during_startup("dflctl", __name__)  # first: a Ctrl-C while the modules below load is one line, exit 130

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

from dfl_agent import __version__
from dfl_agent.cli.fleet import FederationAbsent
from dfl_agent.cli.output import console, json_doc
from dfl_agent.cli.tables import (
    PEER_COLUMNS,
    STATUS_COLUMNS,
    certificate_warnings,
    fmt_cell,
    peer_rows,
    render_table,
    status_rows,
)

# the architecture modes of dfl_agent.models.families.FAMILIES, named here so that building the
# parser does not import torch (tests/unit/test_cli_startup.py checks they agree)
FAMILY_NAMES = ("H0", "H1", "H1-resnet", "H2")


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
    text = Path(value).read_text(encoding="utf-8") if not value.lstrip().startswith("[") else value
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--models must be a JSON list of model specs or a file holding one: {exc}") from None
    if not isinstance(specs, list) or not specs or not all(isinstance(x, dict) for x in specs):
        raise ValueError("--models must be a non-empty JSON list of model spec objects")
    return specs


def _dechw_hint(algorithm: str, raw_options: dict[str, Any], init: str, partition: str | None) -> None:
    """Prints DecHW's common-initialisation hint (one line, stderr) when it applies;
    bad options are left to the run, which reports them."""
    from dfl_agent.algorithms.base import get_algorithm, parse_options

    try:
        cls = get_algorithm(algorithm)
        options = parse_options(cls, raw_options)
    except (KeyError, ValueError):
        return
    hint = cls.common_init_hint(options, init, partition)
    if hint:
        print(hint, file=sys.stderr)


def cmd_simulate(a: argparse.Namespace) -> int:
    from dfl_agent.cli.progress import simulate_with_progress
    from dfl_agent.learning.training import DEFAULT_LR, TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig

    cfg = SimConfig(
        algorithm=a.algorithm, nodes=a.nodes, rounds=a.rounds, dataset=a.dataset, dataset_path=a.dataset_path,
        partition=a.partition, beta=a.beta, zeta=a.zeta, seed=a.seed, out=a.out, options=_kv(a.option),
        train=TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=DEFAULT_LR if a.lr is None else a.lr,
                          lr_is_set=a.lr is not None, momentum=a.momentum, steps=a.steps,
                          divergence_factor=a.divergence_factor),
        model_size=a.model_size,
        init=a.init, baseline_local=a.baseline_local, topology=a.topology,
        topology_options=_kv(a.topology_option),
        model_family=a.models if a.models in FAMILY_NAMES else None, eval_every=a.eval_every,
        model_specs=None if a.models in FAMILY_NAMES else _model_specs(a.models),
        profiles=[p for p in (a.profiles or "").split(",") if p] or None,
        compression=a.compression, error_feedback=a.error_feedback, consensus_step=a.consensus_step,
        samples_per_node=a.samples_per_node, batch=a.batch, device=a.device, straggler=a.straggler,
        speeds=[float(v) for v in a.speeds.split(",")] if a.speeds else None,
        dp_epsilon=a.dp_epsilon, dp_max_grad_norm=a.dp_max_grad_norm, dp_delta=a.dp_delta,
    )
    _dechw_hint(cfg.algorithm, cfg.options, cfg.init, cfg.partition)
    s = simulate_with_progress(cfg, enabled=a.progress)
    if a.json:
        print(json_doc(s, default=float))
        return 0
    g, lo = s["global_accuracy"], s["local_accuracy"]
    print(
        f"{s['algorithm']}: {s['nodes']} nodes, {s['rounds_completed']} rounds on {a.dataset}/{a.partition} in "
        f"{s['wall_seconds']:.1f}s; global accuracy {g['mean']:.4f} ± {g['std']:.4f}, "
        f"local accuracy {lo['mean']:.4f} ± {lo['std']:.4f}; {s['bytes_sent'] / 1e6:.1f} MB sent"
    )
    if s.get("compression", "none") != "none":
        print(f"compression {s['compression']}: {s['compression_ratio']:.1f}x fewer bytes than float32")
    if s.get("dp"):
        dp = s["dp"]
        print(f"differential privacy: epsilon spent {dp['epsilon_spent']:.3g} (at most, over the nodes) at delta "
              f"{dp['delta']:g}, noise multiplier {dp['noise_multiplier']:.3g}, {dp['steps']} DP steps, "
              f"max_grad_norm {dp['max_grad_norm']:g}")
    if "local_only_global_accuracy" in s:
        print(f"local-only baseline: global accuracy {s['local_only_global_accuracy']['mean']:.4f}")
    if a.out:
        print(f"report: {a.out}/summary.json")
    return 0


def _compression_args(p: argparse.ArgumentParser) -> None:
    """``--compression SPEC`` and ``--no-error-feedback`` (issue 8)."""

    def spec(text: str) -> str:
        from dfl_agent.learning.compression import CompressionError, parse_spec

        try:
            return "auto" if text.strip().lower() == "auto" else str(parse_spec(text))
        except CompressionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--compression", default="none", type=spec, metavar="SPEC",
                   help="none, auto, fp16, bf16, q8, q4, q2, topk:0.01+q8, randk:0.1+q8, ...+zstd (the compression how-to lists them)")
    p.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="no residuals / CHOCO copies for sparsified streams (to compare)")


def _straggler_option(p: argparse.ArgumentParser) -> None:
    """``--straggler`` of the reproduction tools (simulate, demo): the papers' lock step by default."""
    from dfl_agent.algorithms.protocols.stragglers import MODES, REPRODUCTION_MODE

    p.add_argument("--straggler", default=REPRODUCTION_MODE, choices=list(MODES),
                   help=f"{REPRODUCTION_MODE}: the papers' lock step (default, so that the papers' figures "
                        "reproduce); quorum: as runtime.straggler = quorum, the always-on agent's default: rounds "
                        "close without the slowest neighbours, adaptive deadlines, late updates weighted")


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def cmd_demo(a: argparse.Namespace) -> int:
    from dfl_agent.cli.demo import DemoOptions, run_demo
    from dfl_agent.extras import require_torch

    require_torch()  # the demo's agents train: say so before starting them

    if a.feed:  # live data in, deployed models out
        from dfl_agent.cli.demo_feed import FeedOptions, run_feed_demo

        unused = [f"--{k}" for k in ("kill", "profiles", "models") if getattr(a, k)]
        if unused:
            print(f"dflctl demo: --feed does not take {', '.join(unused)}", file=sys.stderr)
            return 2

        return run_feed_demo(FeedOptions(
            nodes=a.nodes if a.nodes is not None else 3, runs=a.runs, rounds=a.rounds or 3,
            algorithm=a.algorithm or "fedavg", out=a.out if a.out != "dfl-demo" else "dfl-demo-feed",
            broker=a.broker, seed=a.seed, initial=a.initial, feed_interval=a.feed_interval,
            feed_chunk=a.feed_chunk, max_windows=a.max_windows, live=a.live, epochs=a.epochs or 5,
            round_timeout=a.round_timeout, straggler=a.straggler))
    return run_demo(DemoOptions(
        nodes=a.nodes if a.nodes is not None else 5, rounds=a.rounds or 20, algorithm=a.algorithm or "dfml",
        models=a.models, out=a.out, broker=a.broker, seed=a.seed,
        epochs=a.epochs or 1, round_timeout=a.round_timeout, kill=a.kill, live=a.live, protocol=a.protocol,
        profiles=a.profiles,
        compression=a.compression, error_feedback=a.error_feedback, straggler=a.straggler,
    ))


def _observe(a: argparse.Namespace):
    """The federation's statuses and presence (``--config``'s trust material verifies their
    signatures; without it, or on an unsigned federation, every entry is "unverified").

    Raises:
        dfl_agent.cli.fleet.FederationAbsent: nothing at all heard from the federation.
    """
    from dfl_agent.cli import fleet
    from dfl_agent.cli.observer import Observer

    t = fleet.target(a)
    obs = Observer(t)
    obs.guard = fleet.trust_guard(t)
    obs.start(timeout=a.timeout)
    obs.settle()
    statuses, presence = obs.snapshot()
    obs.stop()
    if not statuses and not presence:
        raise fleet.FederationAbsent(fleet.absent(t))
    return statuses, presence, obs.privacy_watch.view()


def cmd_peers(a: argparse.Namespace) -> int:
    statuses, presence, seen = _observe(a)
    rows = peer_rows(statuses, presence, stale_after=a.stale_after, privacy_seen=seen)
    if a.json:
        print(json_doc(rows, key="peers"))
        return 0

    console().print(render_table("peers", rows, PEER_COLUMNS))
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    statuses, presence, seen = _observe(a)
    if a.node:
        if a.node not in statuses:
            print(f"dflctl: no status for node {a.node!r}", file=sys.stderr)
            return 1
        statuses = {a.node: statuses[a.node]}
    if a.json:
        print(json_doc({"nodes": statuses}, sort_keys=True))
        return 0
    con = console()
    con.print(render_table("status", status_rows(statuses, presence=presence, privacy_seen=seen), STATUS_COLUMNS))
    for line in certificate_warnings(statuses):  # expiring certificates, revoked nodes
        con.print(f"warning: {line}", markup=False)
    if a.node:  # one node: every field of its status document
        for k, v in sorted(statuses[a.node].items()):
            con.print(f"  {k}: {fmt_cell(v) if not isinstance(v, (list, dict)) else json.dumps(v, sort_keys=True)}")
    return 0


def cmd_algorithms(a: argparse.Namespace) -> int:
    from dfl_agent.algorithms.base import available

    if a.json:
        print(json_doc(list(available()), key="algorithms"))
    else:
        print("\n".join(available()))
    return 0


_REST = re.compile(r"``([^`]+)``|:(?:func|class|mod|data|meth):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` without reST markup: ````x```` and ``:func:`x``` become ``x`` (for ``--help``)."""
    return _REST.sub(lambda m: m.group(1) or m.group(2), text)


class DflctlParser(argparse.ArgumentParser):
    """dflctl's parser (every sub-command's too): plain-text help, "did you mean" for a
    mistyped command or option, and errors printed with the usage of the command they
    concern (see :func:`main`)."""

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())

    def error(self, message: str):  # type: ignore[override]
        """Exit 2 with ``message``, plus the closest command or option when one is near."""
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            near = difflib.get_close_matches(bad.group(1), re.findall(r"'([^']*)'", bad.group(2)), n=1)
            if near:
                message = message.replace(" (choose from", f" (did you mean '{near[0]}'?) (choose from", 1)
        elif message.startswith("unrecognized arguments: "):
            options = [o for a in self._actions for o in a.option_strings]
            hints = [f"{w} -> {near[0]}" for w in message.split(": ", 1)[1].split()
                     if w.startswith("-") and (near := difflib.get_close_matches(w.split("=")[0], options, n=1))]
            if hints:
                message += f" (did you mean: {', '.join(hints)}?)"
        super().error(message)


def _mark_subparsers(parser: argparse.ArgumentParser) -> None:
    """Each sub-command's parser records itself (``_dflctl_parser``) when it is chosen."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in set(action.choices.values()):
                sp.set_defaults(_dflctl_parser=sp)
                _mark_subparsers(sp)


def build_parser() -> argparse.ArgumentParser:
    p = DflctlParser(prog="dflctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dflctl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    s = sub.add_parser("simulate", help="N nodes in one process over the memory transport")
    s.add_argument("--algorithm", default="fedavg", help="algorithm to run (dflctl algorithms lists them)")
    s.add_argument("--nodes", type=int, default=10, help="number of simulated nodes")
    s.add_argument("--rounds", type=int, default=20, help="communication rounds")
    s.add_argument("--dataset", default="har", choices=["har", "digits", "idx", "npz", "iris"], help="dataset")
    s.add_argument("--dataset-path", default=None, help="directory for --dataset idx|npz")
    s.add_argument("--partition", default="by-user", choices=["iid", "dirichlet", "shards", "by-user"], help="how the data is split over nodes")
    s.add_argument("--beta", type=float, default=0.5, help="Dirichlet concentration (label skew)")
    s.add_argument("--samples-per-node", type=int, default=0,
                   help="give every node this many samples drawn from the whole pool independently of the "
                        "other nodes (a sample may go to several nodes; replaces --partition; 0: partition)")
    s.add_argument("--no-batch", dest="batch", action="store_false",
                   help="train and evaluate every node on its own instead of training the nodes that share "
                        "architecture, optimizer settings and step count together in one vectorised step (and "
                        "evaluating the nodes that share an architecture together)")
    s.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where every node's models train and evaluate "
                        "(a CUDA device torch does not see: exit 2)")
    s.add_argument("--zeta", type=int, default=2, help="shards (classes) per node")
    s.add_argument("--seed", type=int, default=0, help="random seed (data split, initialisation, sampling)")
    s.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    s.add_argument("--steps", type=int, default=0,
                   help="mini-batch steps per round instead of --epochs passes (0: use --epochs)")
    s.add_argument("--batch-size", type=int, default=32, help="mini-batch size")
    from dfl_agent.learning.training import DEFAULT_ADAM_LR, DEFAULT_LR

    s.add_argument("--lr", type=float, default=None,
                   help=f"SGD learning rate (default {DEFAULT_LR}); given, also the Adam rate of fedd2s, fedper "
                        f"and local_adam (default {DEFAULT_ADAM_LR}) unless their adam_lr option is set")
    s.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    s.add_argument("--divergence-factor", type=float, default=0.0,
                   help="undo a round of local SGD whose batch loss blows up past this multiple of its first "
                        "(the agent's training.divergence_factor; default 0: off, as in the papers)")
    s.add_argument("--model-size", default="medium", choices=["small", "medium", "large"], help="model size of the default model")
    s.add_argument("--init", default="common", choices=["common", "independent"], help="one common initial model, or one per node")
    s.add_argument("--baseline-local", action="store_true", help="also train a local-only copy per node")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="algorithm option (repeatable)")
    s.add_argument("--eval-every", type=int, default=1, help="evaluate every N rounds (and the last)")
    s.add_argument("--topology", default="full", help="communication graph (full, ring, ...)")
    s.add_argument("--topology-option", action="append", default=[], metavar="KEY=VALUE", help="topology option (repeatable)")
    s.add_argument("--models", default=None,
                   help="H0, H1 or H2 (DFML's architecture modes, spread over nodes), or per-node model specs: "
                        "a JSON list (cycled over nodes) or a file holding one")
    s.add_argument("--out", default=None, help="report folder (summary.json, metrics.jsonl, accuracy.png)")
    s.add_argument("--profiles", default=None, metavar="A,B,C",
                   help="device profiles per node (cycled): model size, roles, compression (dflctl profile list)")
    s.add_argument("--json", action="store_true",
                   help="print the summary as one JSON document (schema_version 1) instead of the text line")
    s.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no per-round progress on stderr (a bar on a terminal, else one line per round)")
    _straggler_option(s)
    s.add_argument("--speeds", default=None, metavar="F,F,...",
                   help="per-node speed factors (cycled), e.g. 1,1,1,0.05: a training call takes 1/F virtual "
                        "seconds (default: no virtual training time)")
    s.add_argument("--dp-epsilon", type=float, default=None, metavar="E",
                   help="differential privacy: every node trains with DP-SGD whose whole run spends at most E "
                        "(the privacy extra; summary.json's dp says what each node spent)")
    s.add_argument("--dp-max-grad-norm", type=float, default=1.0, metavar="C",
                   help="with --dp-epsilon: each sample's gradient is clipped to this L2 norm (default 1.0)")
    s.add_argument("--dp-delta", type=float, default=1e-5, metavar="D",
                   help="with --dp-epsilon: the delta of the (epsilon, delta) guarantee (default 1e-5)")
    _compression_args(s)
    s.add_argument("--consensus-step", type=_nonnegative_float, default=0.0, metavar="GAMMA",
                   help="CHOCO's consensus step for compressed gossip, as compression.consensus_step "
                        "(0: automatic, 1 for dense specs and the kept fraction for sparsified ones)")
    s.set_defaults(func=cmd_simulate)

    d = sub.add_parser("demo", help="real agent processes + MQTT broker + mDNS on 127.0.0.1, HAR data")
    d.add_argument("--nodes", type=int, default=None, help="number of agent processes (default 5; 3 with --feed)")
    d.add_argument("--rounds", type=int, default=None, help="rounds each agent runs (default 20; per run with --feed: 3)")
    d.add_argument("--algorithm", default=None,
                   help="algorithm the agents run (dflctl algorithms lists them; default dfml, fedavg with --feed)")
    d.add_argument("--models", default=None, choices=FAMILY_NAMES,
                   help="architecture mode per agent (default H2 for dfml/dfedavg/dfedprox: 5 different CNNs)")
    d.add_argument("--out", default="dfl-demo", help="report folder (logs, metrics, summary, plot)")
    d.add_argument("--broker", default="auto", choices=["auto", "mosquitto", "amqtt"], help="MQTT broker to start (auto: mosquitto if installed, else amqtt)")
    d.add_argument("--protocol", default="5", choices=["5", "3.1.1"], help="MQTT protocol version")
    d.add_argument("--seed", type=int, default=0, help="random seed")
    d.add_argument("--epochs", type=int, default=None, help="local epochs per round (default 1; 5 with --feed)")
    d.add_argument("--round-timeout", type=float, default=30.0, help="seconds a round waits for peers")
    _straggler_option(d)
    d.add_argument("--kill", default=None, metavar="INDEX@ROUND", help="SIGKILL agent INDEX after its round ROUND")
    d.add_argument("--live", dest="live", action="store_true", default=None, help="live table (default on a terminal)")
    d.add_argument("--no-live", dest="live", action="store_false", help="one line per event instead of the live table")
    d.add_argument("--profiles", default=None, metavar="A,B,C",
                   help="device profile per agent (cycled), e.g. raspberry-pi-4,jetson-orin-nano,x86-cpu")
    _compression_args(d)
    f = d.add_argument_group("live data (--feed)")
    f.add_argument("--feed", action="store_true",
                   help="agents train on their sample stores while a feeder adds each user's windows; runs follow "
                        "each other and each deploys a validated model")
    f.add_argument("--runs", type=int, default=2, help="--feed: runs one after the other")
    f.add_argument("--initial", type=float, default=0.25,
                   help="--feed: share of each user's windows in the store at start")
    f.add_argument("--feed-interval", type=float, default=2.0, help="--feed: seconds between the feeder's passes")
    f.add_argument("--feed-chunk", type=int, default=16, help="--feed: windows per agent per pass")
    f.add_argument("--max-windows", type=int, default=None, help="--feed: use at most this many windows per user")
    d.set_defaults(func=cmd_demo)

    from dfl_agent.cli.fleet import add_options as fleet_options

    for name, fn, helptext in (("peers", cmd_peers, "list nodes from retained presence"),
                               ("status", cmd_status, "retained status documents")):
        c = sub.add_parser(name, help=helptext)
        fleet_options(c)
        if name == "status":
            c.add_argument("node", nargs="?", default=None, help="one node's id: show every field of its status")
        else:
            c.add_argument("--stale-after", type=float, default=30.0,
                           help="an online node without a status heartbeat for this many s shows as stale")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        c.set_defaults(func=fn)

    al = sub.add_parser("algorithms", help="list registered algorithms")
    al.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    al.set_defaults(func=cmd_algorithms)
    _register_extensions(sub)
    from dfl_agent.cli.output import apply_formatter

    apply_formatter(p)
    return p


def _register_extensions(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add the commands of every ``tools/cli_*.py`` module.

    Each such module defines ``register(sub)``, which adds its sub-commands to the
    ``dflctl`` sub-parser collection ``sub`` (an ``argparse`` ``_SubParsersAction``)
    and sets ``func`` on each, as the built-in commands above do. Modules are loaded
    in name order; an ``ImportError`` in one (an optional dependency missing) hides
    only its commands.
    """
    import importlib
    import pkgutil

    from dfl_agent import cli as cli_pkg

    for mod in sorted(m.name for m in pkgutil.iter_modules(cli_pkg.__path__) if m.name.startswith("cli_")):
        try:
            module = importlib.import_module(f"dfl_agent.cli.{mod}")
        except ImportError as exc:  # pragma: no cover - depends on installed extras
            print(f"dflctl: commands of dfl_agent.cli.{mod} unavailable: {exc}", file=sys.stderr)
            continue
        module.register(sub)


#: exit codes of every dflctl command (docs/cli.md)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BROKER = 0, 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dflctl`` console script."""
    parser = build_parser()
    _mark_subparsers(parser)
    args, extra = parser.parse_known_args(argv)
    chosen = vars(args).pop("_dflctl_parser", None) or parser
    if extra:  # name the command's own usage, not the top level's
        chosen.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        end_startup()  # from here on Ctrl-C raises KeyboardInterrupt, handled below
        return int(args.func(args) or 0)
    except ConnectionError as exc:  # the broker cannot be used (the line says why)
        print(f"dflctl: {exc}", file=sys.stderr)
        return EXIT_BROKER
    except FederationAbsent as exc:  # nothing heard from the federation: names those the broker carries
        print(f"dflctl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, KeyError, FileNotFoundError, ImportError) as exc:
        from dfl_agent.extras import missing_torch

        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else missing_torch(exc) or exc
        print(f"dflctl: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's code for SIGINT (docs/cli.md)
        print("dflctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
