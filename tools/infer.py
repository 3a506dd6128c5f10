"""``dfl-infer``: the inference-only member's command line (no torch).

  dfl-infer run --broker H:P --federation F [--node-id ID] [--state-dir DIR] [--windows FILE]
      join the federation, receive the current model as ONNX, predict on FILE after each one
  dfl-infer predict --model M.onnx --windows FILE [--json] [--label-column]
      predictions with onnxruntime on a .npz or .csv of windows

Exit codes: 0 ok, 2 bad input (message names it), 3 broker unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import sys
from typing import Any

from dfl_agent.inference.windows import load_windows, predictions_document
from dfl_agent.onnx_model import InferenceError, OnnxModel


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


async def _run(a: argparse.Namespace) -> int:
    from dfl_agent.inference.member import InferenceMember

    nid = a.node_id or "infer-" + secrets.token_hex(3)
    member = InferenceMember(nid, a.federation, state_dir=a.state_dir, broker=a.broker, windows=a.windows,
                             threads=a.threads, protocol=a.protocol)
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
    if a.mdns_interface:
        from dfl_agent.discovery.mdns import MdnsDiscovery

        mdns = MdnsDiscovery(member.peers, node_id=nid, federation=a.federation, descriptor=member.descriptor,
                             interfaces=[a.mdns_interface])
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
    r.add_argument("--broker", default="127.0.0.1:1883", help="MQTT broker host:port")
    r.add_argument("--federation", required=True, help="federation name (the MQTT topic prefix dfl/FEDERATION/)")
    r.add_argument("--node-id", default=None, help="node id (default: infer- and 6 random hex digits)")
    r.add_argument("--state-dir", default="/var/lib/dfl-infer", help="folder for the received ONNX model")
    r.add_argument("--windows", default=None, help=".npz or .csv of windows to predict on")
    r.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    r.add_argument("--protocol", default="5", choices=["5", "3.1.1"], help="MQTT protocol version")
    r.add_argument("--mdns-interface", default=None, help="advertise over mDNS on this interface address")
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
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "predict":
            return predict_command(a.model, a.windows, as_json=a.json, label_column=a.label_column, threads=a.threads)
        logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(_run(a))
    except InferenceError as exc:
        print(f"dfl-infer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
