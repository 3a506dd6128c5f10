"""One process against two worker processes for the simulator's round work.

The simulator runs every node in one process.  This experiment measures what a design
that spreads node groups over worker processes would really cost, with the simulator's
own components, for fedavg on digits (IID, full graph, the simulator's default model,
data split, initialisation and per-node batch order).

One round of one node group (:class:`Group`), as the simulator does it for fedavg:

1. train every node of the group in one vectorised step
   (:func:`dfl_agent.runtime.node.batching.train_group`, batch order from each node's own
   generator, as ``BatchTrainer`` draws it);
2. encode each node's model as a broadcast wire frame (:func:`dfl_agent.transport.wire.encode`);
3. decode each received broadcast once (the simulator shares one decoded copy among
   all receivers in its process), check it for every receiver (``update_problem``),
   and replace each node's model by the sample-weighted average of its own and the
   99 received models (``robust_aggregate``, ``load_numpy``);
4. evaluate each node on the global test set and its validation split.

Configurations, measured in the same run:

- ``single``: one group of all N nodes, in this process (the simulator's design).
- ``workers``: two worker processes (``spawn`` context, one torch thread each), each
  holding half of the nodes (their data and models stay in the worker).  Per round the
  parent asks both to train and encode; each returns its frames (pickled over a pipe);
  the parent sends each worker the other worker's frames, and each decodes all N
  broadcasts and aggregates and evaluates its own half.  That is the traffic any
  worker design has: every broadcast reaches every process that hosts a receiver.

After each pair the final parameters of every node are compared (they must agree
within float tolerance: the same seeds, batch orders and averaging order).

Records wall and CPU seconds (this process plus its workers) of the rounds, and of the
whole configuration including set-up (worker start, imports, data), the load average
at start and end, and writes one line per measurement to ``workers.jsonl``;
``--report`` writes ``workers.md``.

Usage (repository root; the machine may be shared, so use nice)::

    nice -n 10 python bench/scale/workers.py --nodes 100 --repeats 3
    nice -n 10 python bench/scale/workers.py --nodes 100 --repeats 3 --epochs 10
    python bench/scale/workers.py --report
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FEDERATION = "sim"


class Group:
    """The nodes ``indices`` of an N-node fedavg digits IID simulation, built as the
    simulator builds them (same partition, split, model spec, initial weights and
    per-node generators).

    Args:
        nodes: N, the simulation's node count.
        indices: the node indices this group holds.
        seed: the simulation seed.
        epochs: local epochs per round (``TrainConfig.epochs``).
    """

    def __init__(self, nodes: int, indices: list[int], seed: int, epochs: int):
        import torch

        from dfl_agent.data import load_dataset, make_node_data, partition
        from dfl_agent.learning.training import TrainConfig
        from dfl_agent.models import build_model
        from dfl_agent.runtime.node.node import init_seed_for
        from dfl_agent.runtime.node.simulator import node_name
        from dfl_agent.runtime.shared.assembly import simulator_default_specs

        torch.set_num_threads(1)
        bundle = load_dataset("digits")
        parts = partition(bundle.pool, nodes, "iid", seed=seed)
        specs = simulator_default_specs("fedavg", bundle.pool.input_shape, bundle.pool.num_classes, nodes)
        self.indices = list(indices)
        self.names = [node_name(i) for i in self.indices]
        self.cfg = TrainConfig(epochs=epochs)
        self.data = [make_node_data(bundle, parts[i], seed=seed) for i in self.indices]
        self.models = []
        for i in self.indices:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed_for(seed, i, "common"))
                self.models.append(build_model(specs[i]))
        self.rngs = [np.random.default_rng([seed, i]) for i in self.indices]
        self.test_x, self.test_y = bundle.test.x, bundle.test.y
        self.own_frames: dict[str, bytes] = {}

    def train(self, t: int) -> dict[str, bytes]:
        """Round ``t``, steps 1 and 2: train the group in one vectorised step and encode
        each node's broadcast; returns ``{node id: frame}``."""
        from dfl_agent.algorithms.context import Message
        from dfl_agent.learning.params import model_to_numpy
        from dfl_agent.learning.training import round_batches
        from dfl_agent.runtime.node.batching import train_group
        from dfl_agent.transport import wire

        members = [(m, d.train_x, d.train_y, round_batches(len(d.train_x), self.cfg, rng))
                   for m, d, rng in zip(self.models, self.data, self.rngs)]
        if len({len(b) for *_, b in members}) != 1:
            raise ValueError("the nodes' step counts differ: they would not train in one group")
        train_group(members, self.cfg)
        frames = {}
        for name, m, d in zip(self.names, self.models, self.data):
            msg = Message(kind="model", round=t, tensors=model_to_numpy(m), meta={"samples": int(len(d.train_y))})
            frames[name] = wire.encode(msg, federation=FEDERATION, sender=name)
        self.own_frames = frames
        return frames

    def aggregate_and_evaluate(self, t: int, received: dict[str, bytes]) -> float:
        """Round ``t``, steps 3 and 4: decode every broadcast once (``received`` plus
        this group's own), average each node's model with all the others (sorted by
        sender, as fedavg does) and evaluate; returns the mean global accuracy."""
        from dfl_agent.algorithms.protocols.neighbourhood import update_problem
        from dfl_agent.learning.params import load_numpy, model_to_numpy
        from dfl_agent.learning.robust import robust_aggregate
        from dfl_agent.learning.training import evaluate
        from dfl_agent.transport import wire

        frames = {**received, **self.own_frames}
        decoded = {s: wire.decode(f, federation=FEDERATION) for s, f in frames.items()}
        accs = []
        for name, m, d in zip(self.names, self.models, self.data):
            own = model_to_numpy(m)
            senders = sorted(s for s in decoded if s != name)
            for s in senders:
                problem = update_problem(decoded[s], own)
                if problem:
                    raise ValueError(f"{s}: {problem}")
            avg, _ = robust_aggregate(own, [decoded[s].tensors for s in senders],
                                      [len(d.train_y)] + [decoded[s].meta["samples"] for s in senders])
            load_numpy(m, avg)
            accs.append(evaluate(m, self.test_x, self.test_y)["accuracy"])
            evaluate(m, d.val_x, d.val_y)
        self.own_frames = {}
        return float(np.mean(accs))

    def params(self) -> dict[str, dict[str, np.ndarray]]:
        """``{node id: {parameter: array}}`` of the group's current models."""
        from dfl_agent.learning.params import model_to_numpy

        return {name: model_to_numpy(m) for name, m in zip(self.names, self.models)}


# -- worker process side --------------------------------------------------------------
_GROUP: Group | None = None


def _init_worker(nodes: int, indices: list[int], seed: int, epochs: int) -> None:
    global _GROUP
    _GROUP = Group(nodes, indices, seed, epochs)


def _w_cpu() -> float:
    return time.process_time()


def _w_train(t: int) -> dict[str, bytes]:
    assert _GROUP is not None
    return _GROUP.train(t)


def _w_aggregate(t: int, received: dict[str, bytes]) -> float:
    assert _GROUP is not None
    return _GROUP.aggregate_and_evaluate(t, received)


def _w_params() -> dict[str, dict[str, np.ndarray]]:
    assert _GROUP is not None
    return _GROUP.params()


# -- the two configurations ----------------------------------------------------------
def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_single(nodes: int, rounds: int, seed: int, epochs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The simulator's design: one group of all nodes in this process.  Returns
    ``(timings, final parameters)``."""
    import torch

    torch.set_num_threads(1)
    w0, c0 = time.perf_counter(), time.process_time()
    group = Group(nodes, list(range(nodes)), seed, epochs)
    w1, c1 = time.perf_counter(), time.process_time()
    acc, per_round, per_round_cpu, frame_bytes = float("nan"), [], [], 0
    for t in range(1, rounds + 1):
        r0, rc0 = time.perf_counter(), time.process_time()
        frame_bytes = len(next(iter(group.train(t).values())))
        acc = group.aggregate_and_evaluate(t, {})
        per_round.append(round(time.perf_counter() - r0, 3))
        per_round_cpu.append(round(time.process_time() - rc0, 3))
    w2, c2 = time.perf_counter(), time.process_time()
    return ({"rounds_wall_s": w2 - w1, "rounds_cpu_s": c2 - c1, "total_wall_s": w2 - w0,
             "total_cpu_s": c2 - c0, "round_wall_s": per_round, "round_cpu_s": per_round_cpu,
             "frame_bytes": frame_bytes, "global_accuracy": acc}, group.params())


def run_workers(nodes: int, rounds: int, seed: int, epochs: int, workers: int = 2,
                context: str = "spawn") -> tuple[dict[str, Any], dict[str, Any]]:
    """Node groups spread over ``workers`` processes (contiguous halves of the node
    indices); broadcasts relayed by this process.  Returns ``(timings, final parameters)``.

    CPU of the rounds = this process's CPU over the rounds plus each worker's CPU
    between the first round and the end (asked from the worker).  CPU in total = this
    process's CPU plus ``RUSAGE_CHILDREN`` of the workers, which have ended (start-up,
    imports and data included).
    """
    ctx = multiprocessing.get_context(context)
    chunks = [list(c) for c in np.array_split(np.arange(nodes), workers)]
    w0, c0, ch0 = time.perf_counter(), time.process_time(), _children_cpu()
    pools = [cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                    initargs=(nodes, [int(i) for i in c], seed, epochs)) for c in chunks]
    try:
        wcpu0 = [f.result() for f in [p.submit(_w_cpu) for p in pools]]  # waits until every worker is set up
        w1, c1 = time.perf_counter(), time.process_time()
        acc, per_round, per_round_cpu, frame_bytes = float("nan"), [], [], 0
        wcpu = wcpu0
        for t in range(1, rounds + 1):
            r0, rc0 = time.perf_counter(), time.process_time()
            outs = [f.result() for f in [p.submit(_w_train, t) for p in pools]]
            frame_bytes = len(next(iter(outs[0].values())))
            futs = []
            for k, p in enumerate(pools):  # each worker gets every other worker's broadcasts
                received = {s: fr for j, o in enumerate(outs) if j != k for s, fr in o.items()}
                futs.append(p.submit(_w_aggregate, t, received))
            accs = [f.result() for f in futs]
            acc = float(np.average(accs, weights=[len(c) for c in chunks]))
            per_round.append(round(time.perf_counter() - r0, 3))
            wcpu1 = [f.result() for f in [p.submit(_w_cpu) for p in pools]]  # a round trip: not in round_wall_s
            per_round_cpu.append(round(time.process_time() - rc0 + sum(b - a for a, b in zip(wcpu, wcpu1)), 3))
            wcpu = wcpu1
        w2, c2 = time.perf_counter(), time.process_time()
        params: dict[str, Any] = {}
        for f in [p.submit(_w_params) for p in pools]:
            params.update(f.result())
    finally:
        for p in pools:
            p.shutdown(wait=True)
    w3, c3 = time.perf_counter(), time.process_time()
    children = _children_cpu() - ch0
    return ({"rounds_wall_s": w2 - w1, "rounds_cpu_s": (c2 - c1) + sum(b - a for a, b in zip(wcpu0, wcpu1)),
             "total_wall_s": w3 - w0, "total_cpu_s": (c3 - c0) + children, "round_wall_s": per_round,
             "round_cpu_s": per_round_cpu, "frame_bytes": frame_bytes, "global_accuracy": acc,
             "workers": workers, "context": context}, params)


def max_param_diff(a: dict[str, dict[str, np.ndarray]], b: dict[str, dict[str, np.ndarray]]) -> float:
    """Largest absolute difference between two ``{node: {parameter: array}}`` sets.

    Raises:
        AssertionError: different nodes or parameter names.
    """
    assert sorted(a) == sorted(b), "different node sets"
    worst = 0.0
    for n in a:
        assert sorted(a[n]) == sorted(b[n]), f"{n}: different parameter names"
        for k in a[n]:
            worst = max(worst, float(np.max(np.abs(a[n][k].astype(np.float64) - b[n][k]))))
    return worst


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compare(nodes: int, rounds: int, seed: int, epochs: int, order: tuple[str, ...] = ("single", "workers"),
            atol: float = 1e-5) -> list[dict[str, Any]]:
    """Run both configurations (in ``order``) and check that they end with the same
    parameters (``atol``); returns one record per configuration.

    Raises:
        AssertionError: the final parameters differ by more than ``atol``.
    """
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    loads: dict[str, tuple[list[float], list[float]]] = {}
    for mode in order:
        load0 = [round(x, 2) for x in os.getloadavg()]
        out[mode] = run_single(nodes, rounds, seed, epochs) if mode == "single" else run_workers(
            nodes, rounds, seed, epochs)
        loads[mode] = (load0, [round(x, 2) for x in os.getloadavg()])
    diff = max_param_diff(out["single"][1], out["workers"][1])
    assert diff <= atol, f"single-process and worker parameters differ by {diff:g} > {atol:g}"
    records = []
    for mode in order:
        timing = out[mode][0]
        records.append({
            "mode": mode, "nodes": nodes, "rounds": rounds, "seed": seed, "epochs": epochs,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in timing.items()},
            "loadavg_start": loads[mode][0], "loadavg_end": loads[mode][1], "max_param_diff": diff,
            "cpus": os.cpu_count(), "code": _commit(),
        })
    return records


def report() -> None:
    """Write ``workers.md`` from ``workers.jsonl``: medians per setup and mode, and the
    ratios of the medians."""
    cells = [json.loads(x) for x in (HERE / "workers.jsonl").read_text().splitlines() if x.strip()]
    lines = ["# One process against two worker processes (generated by `python bench/scale/workers.py --report`)",
             "", "fedavg, digits IID, full graph, the simulator's default model; per round: batched training, "
             "encoding of every broadcast, decoding, checks and sample-weighted averaging of all N models "
             "for every node, evaluation on the test set and the validation split. `single`: all nodes in "
             "one process (the simulator's design); `workers`: two spawned worker processes holding half of "
             "the nodes each, broadcasts relayed through the parent. The two modes of one repeat ran one "
             "after the other (order alternating), and ended with the same parameters (`max diff`). "
             "CPU = parent + workers. 2-core x86 VM shared with other jobs (load average in the table). "
             "Not in either mode: the simulator's event-loop bookkeeping of messages and peers.", "",
             "| nodes | epochs | seed | mode | rounds wall s | rounds CPU s | total wall s | total CPU s | "
             "load start/end | max diff | code |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['nodes']} | {c['epochs']} | {c['seed']} | {c['mode']} | {c['rounds_wall_s']} | "
                     f"{c['rounds_cpu_s']} | {c['total_wall_s']} | {c['total_cpu_s']} | "
                     f"{c['loadavg_start'][0]}/{c['loadavg_end'][0]} | {c['max_param_diff']:.1e} | {c['code']} |")
    lines += ["", "Medians over the repeats (ratio = workers / single; below 1 the workers are faster). "
              "`later rounds`: rounds 2 and up, after each process's first vectorised step. The rounds' CPU includes "
              "every process's; `total` adds the set-up (data, models, and for `workers` the start and imports "
              "of the two processes):", "",
              "| nodes | rounds | epochs | runs | measure | single | workers | ratio |",
              "|---|---|---|---|---|---|---|---|"]

    def value(c: dict, field: str) -> float:
        if field.startswith("later_"):  # rounds 2 and up
            return float(sum(c["round_" + field[6:]][1:]))
        return float(c[field])

    for key in sorted({(c["nodes"], c["rounds"], c["epochs"]) for c in cells}):
        sel = {m: [c for c in cells if (c["nodes"], c["rounds"], c["epochs"]) == key and c["mode"] == m]
               for m in ("single", "workers")}
        if not sel["single"] or not sel["workers"]:
            continue
        for field, label in (("rounds_wall_s", "rounds wall s"), ("rounds_cpu_s", "rounds CPU s"),
                             ("later_wall_s", "later rounds wall s"), ("later_cpu_s", "later rounds CPU s"), ("total_wall_s", "total wall s (with set-up)"),
                             ("total_cpu_s", "total CPU s (with set-up)")):
            s = statistics.median(value(c, field) for c in sel["single"])
            w = statistics.median(value(c, field) for c in sel["workers"])
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(sel['single'])} | {label} | {s:.2f} | "
                         f"{w:.2f} | **{w / s:.2f}** |")
    commands = sorted({c["command"] for c in cells if c.get("command")})
    lines += ["", "`single` ran in a process already warmed up (imports, data set cache, first vectorised step); "
              "a fresh simulation pays that once more (about 7 CPU s on the 2-core VM measured), while each worker pays "
              "it in its `total`.", "", "Commands (repository root):", "", "```sh",
              *commands, "python bench/scale/workers.py --report", "```"]
    (HERE / "workers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100, help="node count")
    ap.add_argument("--rounds", type=int, default=3, help="rounds")
    ap.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    ap.add_argument("--repeats", type=int, default=3, help="repeats (seeds 0, 1, ...)")
    ap.add_argument("--report", action="store_true", help="only write workers.md from workers.jsonl")
    ap.add_argument("--out", default=str(HERE / "workers.jsonl"), help="JSON lines file to append to")
    a = ap.parse_args()
    if a.report:
        report()
        return
    import torch

    torch.set_num_threads(1)
    compare(4, 1, 0, 1)  # warm-up: imports, dataset cache, first vmap
    command = (f"nice -n 10 python bench/scale/workers.py --nodes {a.nodes} --rounds {a.rounds} "
               f"--epochs {a.epochs} --repeats {a.repeats}")
    for r in range(a.repeats):
        order = ("single", "workers") if r % 2 == 0 else ("workers", "single")
        for rec in compare(a.nodes, a.rounds, r, a.epochs, order):
            rec["command"] = command
            print(json.dumps(rec), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
