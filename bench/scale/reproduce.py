"""Do the simulator's figures reproduce across a change? Run small simulations and compare.

Runs each case with ``round_records`` and with ``simulate`` on the ``dfl_agent`` package this
Python imports (``PYTHONPATH`` may point at an older one, laid out as installed) and writes
every round record and the summary, without the wall-clock timings, to a JSON file.
``--compare OLD NEW`` lists every field that differs, case by case.

Two inputs of a frame's bytes are not a function of the seed: the envelope's send time
(``time.time()``, a float whose JSON length varies) and its random message id.  Both are
fixed here (a constant time, ids from a counter restarted for every run), so that byte
counts reproduce too; nothing else is patched.

Usage (repository root)::

    python bench/scale/reproduce.py --out /tmp/new.json
    PYTHONPATH=<package of 75535c2> python bench/scale/reproduce.py --out /tmp/old.json
    python bench/scale/reproduce.py --compare /tmp/old.json /tmp/new.json [--ignore peers_found]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
import types
from typing import Any

#: the cases: neighbourhood algorithms on sparse graphs (presence on the graph, the delivery
#: rule, a killed node), the full graph, a compressed stream, a rotating and a pairs algorithm
CASES: dict[str, dict[str, Any]] = {
    "fedavg_ring": dict(algorithm="fedavg", nodes=20, rounds=3, dataset="digits", partition="iid",
                        samples_per_node=16, topology="ring"),
    "fedavg_er": dict(algorithm="fedavg", nodes=30, rounds=3, dataset="digits", partition="iid",
                      topology="erdos_renyi", topology_options={"p": 0.2}),
    "dechw_er": dict(algorithm="dechw", nodes=20, rounds=3, dataset="digits", partition="iid",
                     topology="erdos_renyi", topology_options={"p": 0.2}),
    "dechw_ring_kill": dict(algorithm="dechw", nodes=4, rounds=4, dataset="digits", partition="iid", topology="ring",
                            kill={2: 2}),
    "cfa_ring_q8": dict(algorithm="cfa", nodes=12, rounds=3, dataset="digits", partition="iid", topology="ring",
                        compression="q8"),
    "fedavg_full": dict(algorithm="fedavg", nodes=10, rounds=3, dataset="digits", partition="iid"),
    "dfml_ring": dict(algorithm="dfml", nodes=6, rounds=3, dataset="digits", partition="iid", topology="ring"),
    "defkt_er": dict(algorithm="defkt", nodes=10, rounds=3, dataset="digits", partition="iid",
                     topology="erdos_renyi", topology_options={"p": 0.4}),
    # the committed bench/results/simulate_fedavg_har_10x20.json's command (bench/simulate_fedavg_har.sh)
    "fedavg_har_10x20": dict(algorithm="fedavg", nodes=10, rounds=20, dataset="har", partition="by-user", seed=0),
    # bench/dechw's setting (digits, Dirichlet 0.2, independent init, Erdos-Renyi p = 0.2), 10 rounds
    "dechw_bench_digits": dict(algorithm="dechw", nodes=20, rounds=10, dataset="digits", partition="dirichlet",
                               beta=0.2, init="independent", topology="erdos_renyi", topology_options={"p": 0.2},
                               train={"epochs": 5, "batch_size": 32, "lr": 0.05, "momentum": 0.5},
                               model_size="medium"),
}
#: the default cases (the two benchmark settings take a few minutes: ``--cases`` adds them)
DEFAULT = [c for c in CASES if c not in ("fedavg_har_10x20", "dechw_bench_digits")]
#: real-time measurements in records and summaries (not results)
TIMING = {"wall", "wall_seconds", "round_wall_s", "wait_s", "train_s", "encode_s", "send_s", "receive_s", "eval_s"}


def _clean(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items() if k not in TIMING and not k.startswith("startup_")}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def run(names: list[str]) -> dict[str, Any]:
    """Every case's records and summary (timings left out)."""
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig, round_records, simulate
    from dfl_agent.transport import wire

    def config(name: str) -> Any:
        kw = dict(CASES[name])
        if "train" in kw:
            kw["train"] = TrainConfig(**kw["train"])
        return SimConfig(**kw)

    ids = [itertools.count()]
    wire.time = types.SimpleNamespace(time=lambda: 1.7e9, perf_counter=time.perf_counter,  # type: ignore[attr-defined]
                                      monotonic=time.monotonic)
    wire.os = types.SimpleNamespace(  # type: ignore[attr-defined]
        urandom=lambda n: hashlib.blake2b(str(next(ids[0])).encode()).digest()[:n])
    out = {}
    for name in names:
        ids[0] = itertools.count()
        records = round_records(config(name))
        ids[0] = itertools.count()
        summary = simulate(config(name))
        out[name] = _clean({"records": records, "summary": summary})
        digest = hashlib.sha256(json.dumps(out[name], sort_keys=True, default=str).encode()).hexdigest()[:16]
        print(name, digest, flush=True)
    return out


def compare(old: dict[str, Any], new: dict[str, Any], ignore: set[str]) -> int:
    """Print every differing field; returns the number of differences."""
    total = 0

    def diff(x: Any, y: Any, path: str) -> int:
        if type(x) is not type(y):
            print("type", path, str(x)[:80], str(y)[:80])
            return 1
        if isinstance(x, dict):
            n = 0
            for k in sorted(set(x) | set(y)):
                if k in ignore:
                    continue
                if k not in x or k not in y:
                    print("only in", "old" if k in x else "new", f"{path}/{k}")
                    n += 1
                else:
                    n += diff(x[k], y[k], f"{path}/{k}")
            return n
        if isinstance(x, list):
            if len(x) != len(y):
                print("length", path, len(x), len(y))
                return 1
            return sum(diff(u, v, f"{path}[{i}]") for i, (u, v) in enumerate(zip(x, y)))
        if x != y:
            print("value", path, str(x)[:80], str(y)[:80])
            return 1
        return 0

    for case in sorted(set(old) & set(new)):
        n = diff(old[case], new[case], case)
        print(f"{case}: {n} differences")
        total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the cases' outputs to this JSON file")
    ap.add_argument("--cases", nargs="*", default=DEFAULT, help=f"case names (default: {', '.join(DEFAULT)})")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two outputs")
    ap.add_argument("--ignore", nargs="*", default=[], help="--compare: field names to leave out")
    a = ap.parse_args()
    if a.compare:
        old, new = (json.load(open(p)) for p in a.compare)
        sys.exit(1 if compare(old, new, set(a.ignore)) else 0)
    out = run(a.cases)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, sort_keys=True, indent=1, default=str)


if __name__ == "__main__":
    main()
