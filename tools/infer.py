"""``dfl-infer``: the inference-only member's command line (no torch).

  dfl-infer run [--config NODE.toml] [--broker H:P] [--federation F] [-u USER --password-file FILE]
                [--cafile CA] [--node-id ID] [--state-dir DIR] [--windows FILE]
      join the federation, receive the current model as ONNX, predict on FILE after each one.
      --config takes a node configuration (its [mqtt], [security] and [discovery] sections:
      e.g. the credentials file of `dflctl keys enroll`); with security.require_signatures a
      model is taken only from an enrolled device, in a frame whose signature verifies
  dfl-infer predict --model M.onnx --windows FILE [--json] [--label-column]
      predictions with onnxruntime on a .npz or .csv of windows

Exit codes: 0 ok, 2 bad input (message names it), 3 broker unreachable.
"""

from __future__ import annotations

from dfl_agent.interrupt import EXIT_INTERRUPTED, during_startup, end_startup

during_startup("dfl-infer", __name__)  # first: a Ctrl-C while the modules below load is one line, exit 130

import argparse
import asyncio
import logging
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from dfl_agent.inference.windows import load_windows, predictions_document
from dfl_agent.onnx_model import InferenceError, OnnxModel

#: where ``dfl-infer run`` keeps its key and model without ``--state-dir`` or ``--config``
DEFAULT_STATE_DIR = "/var/lib/dfl-infer"


def predict_command(model: str, windows: str, *, as_json: bool, label_column: bool = False, threads: int = 1,
                    out: Any = None) -> int:
    """``predict``: shared by ``dfl-infer predict`` and ``dflctl predict``; writes to ``out``
    (default: the current ``sys.stdout``, looked up at call time)."""
    if out is None:
        out = sys.stdout
    m = OnnxModel.from_file(model, threads)
    x, y = load_windows(windows, m.input_shape, label_column=label_column)
    doc = predictions_document(m, x, y, {"model": model, "windows": windows})
    if as_json:
        from dfl_agent.cli.output import json_doc

        print(json_doc(doc, indent=None), file=out)
        return 0
    counts: dict[int, int] = {}
    for label in doc["labels"]:
        counts[label] = counts.get(label, 0) + 1
    acc = f", accuracy {doc['accuracy']:.4f}" if "accuracy" in doc else ""
    print(f"{doc['n']} windows{acc}; predicted labels: "
          + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), file=out)
    return 0


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    """The member's settings from ``--config`` and the options (an option given overrides the
    configuration's value): ``InferenceMember`` arguments, ``target`` (the broker, as dflctl
    connects) and ``mdns`` (interface addresses).

    Raises:
        ValueError: an invalid configuration or option (the message names it).
        dfl_agent.runtime.shared.config.ConfigError, StartupError: from the configuration or its keys.
    """
    from dfl_agent.cli.fleet import target

    t = target(a)
    cfg = t.config
    nid = a.node_id or (cfg.node_id if cfg is not None else None) or "infer-" + secrets.token_hex(3)
    state_dir = a.state_dir or (cfg.state_dir if cfg is not None else DEFAULT_STATE_DIR)
    mqtt: dict[str, Any] = {"username": t.username, "password": t.password, "tls_ca": t.tls_ca,
                            "tls_cert": t.tls_cert, "tls_key": t.tls_key}
    member: dict[str, Any] = {"broker": t.broker, "protocol": a.protocol or t.protocol, "mqtt": mqtt}
    mdns = [a.mdns_interface] if a.mdns_interface else []
    if cfg is not None:
        member["heartbeat_interval"] = cfg.mqtt.heartbeat_interval
        member["max_frame_bytes"] = cfg.mqtt.max_frame_bytes
        mqtt.update(keepalive=cfg.mqtt.keepalive, chunk_size=cfg.mqtt.chunk_size)
        if not mdns and cfg.discovery.mdns:
            mdns = [str(i) for i in cfg.discovery.interfaces]
        if cfg.discovery.interfaces:
            member["address"] = str(cfg.discovery.interfaces[0])
    elif a.mdns_interface:
        member["address"] = a.mdns_interface
    return {"node_id": nid, "federation": t.federation, "state_dir": state_dir, "member": member, "target": t,
            "mdns": mdns}


def _check_broker(a: argparse.Namespace, s: dict[str, Any]) -> bool:
    """dflctl's connection check, in the main thread (Ctrl-C ends its wait at once): False,
    after one line saying why, when the broker cannot be used (refused login, TLS, address)."""
    from dfl_agent.cli.fleet import BrokerError, close

    try:
        close(s["target"].open("dfl-infer", a.timeout))
    except BrokerError as exc:
        print(f"dfl-infer: {exc}", file=sys.stderr)
        return False
    return True


async def _run(a: argparse.Namespace, s: dict[str, Any]) -> int:
    """``run``: the member with settings ``s`` (:func:`_settings`) until SIGTERM or SIGINT."""
    from dfl_agent.inference.member import InferenceMember

    nid = s["node_id"]
    cfg = s["target"].config
    if cfg is not None:  # its key, certificate and trust store: signs, and verifies every model
        from dfl_agent.runtime.shared.assembly import build_security

        Path(s["state_dir"]).mkdir(parents=True, exist_ok=True)
        s["member"]["guard"] = build_security(cfg, Path(s["state_dir"]), nid)
    member = InferenceMember(nid, s["federation"], state_dir=s["state_dir"], windows=a.windows, threads=a.threads,
                             **s["member"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await member.start()
    except ConnectionError as exc:
        logging.getLogger("dfl-infer").error("%s", exc)
        return 3
    mdns = None
    if s["mdns"]:
        from dfl_agent.discovery.mdns import DESCRIPTOR_KEYS, MdnsDiscovery

        # the presence alone carries the address, the certificate and the wire versions (mDNS names them itself)
        advertised = {k: v for k, v in member.descriptor.items() if k in DESCRIPTOR_KEYS}
        mdns = MdnsDiscovery(member.peers, node_id=nid, federation=s["federation"], descriptor=advertised,
                             interfaces=s["mdns"])
        await mdns.start()
    try:
        await member.run(stop)
    finally:
        if mdns is not None:
            await mdns.stop()
        await member.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``dfl-infer`` argument parser (also walked by ``dfl_agent.cli.gen_reference``)."""
    from dfl_agent import __version__
    from dfl_agent.cli.output import HelpFormatter as fmt

    p = argparse.ArgumentParser(prog="dfl-infer", description=__doc__, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"dfl-infer {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="join a federation as an inference-only member", formatter_class=fmt)
    from dfl_agent.cli.fleet import add_options

    add_options(r, timeout=10.0)
    r.add_argument("--node-id", default=None,
                   help="node id (default: node_id of --config, else infer- and 6 random hex digits)")
    r.add_argument("--state-dir", default=None,
                   help=f"folder for the node key and the received ONNX model (default: state_dir of --config, "
                        f"else {DEFAULT_STATE_DIR})")
    r.add_argument("--windows", default=None, help=".npz or .csv of windows to predict on")
    r.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    r.add_argument("--protocol", default=None, choices=["5", "3.1.1"],
                   help="MQTT protocol version (default: mqtt.protocol of --config, else 5)")
    r.add_argument("--mdns-interface", default=None,
                   help="advertise over mDNS on this interface address (default: [discovery] of --config)")
    r.add_argument("--log-level", default="info", help="debug, info, warning or error")
    pr = sub.add_parser("predict", help="predict with an ONNX model on a window file", formatter_class=fmt)
    pr.add_argument("--model", required=True, help="ONNX model file")
    pr.add_argument("--windows", required=True, help=".npz or .csv of windows")
    pr.add_argument("--label-column", action="store_true", help="CSV: the last column is the label")
    pr.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    pr.add_argument("--json", action="store_true", help="one JSON document (schema_version 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dfl-infer`` console script; returns the exit code."""
    from dfl_agent.runtime.shared.assembly import StartupError

    a = build_parser().parse_args(argv)
    try:
        end_startup()  # from here on Ctrl-C raises KeyboardInterrupt, handled below
        if a.cmd == "predict":
            return predict_command(a.model, a.windows, as_json=a.json, label_column=a.label_column, threads=a.threads)
        logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        s = _settings(a)
        if not _check_broker(a, s):
            return 3
        return asyncio.run(_run(a, s))
    except InferenceError as exc:
        print(f"dfl-infer: {exc}", file=sys.stderr)
        return 2
    except (ValueError, StartupError) as exc:  # a bad configuration, option or key file (names it)
        print(f"dfl-infer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the member's own handler (run), or during predict
        print("dfl-infer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
