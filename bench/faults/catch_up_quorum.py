"""A node far behind its federation under ``runtime.straggler = "quorum"``: how it catches up.

FedAvg (digits, the small model) in virtual time (``run_virtual``: waits cost no wall time):
node ``me`` starts at round 1 while its two neighbours send it their update of round
``AHEAD + 1, AHEAD + 2, ...`` one a second, whatever it does, up to the run's last round.
Three catch-up rules:

* ``uncapped``: a skip goes straight to the neighbours' round (the rule under quorum before
  the cap held there; emulated with ``max_catch_up_rounds`` = the run's length);
* ``capped-wait``: at most ``max_catch_up_rounds`` (10) per skip, and each round waits its
  deadline for updates of its own round (the cap alone; emulated by turning
  ``RuntimeContext.catching_up`` off);
* ``capped``: the agent's rule: at most 10 per skip, and a round that a capped skip left behind
  closes as soon as the neighbours' newest updates are there.

Run from the repository root::

    .venv/bin/python bench/faults/catch_up_quorum.py > bench/faults/catch_up_quorum.json
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from dfl_agent.algorithms.base import get_algorithm
from dfl_agent.algorithms.context import Message
from dfl_agent.algorithms.protocols.neighbourhood import arrival_check
from dfl_agent.algorithms.protocols.stragglers import StragglerPolicy, quorum_options
from dfl_agent.data import load_dataset, node_data_for
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import TrainConfig
from dfl_agent.models import default_spec
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.transport.memory import MemoryNetwork, run_virtual

AHEAD, FINAL, PERIOD, CAP, ROUND_TIMEOUT = 50, 120, 1.0, 10, 10.0


def _ctx(net: MemoryNetwork, nid: str, **kw) -> RuntimeContext:
    return RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                          init_seed=1, rng=np.random.default_rng(0), **kw)


def run(rule: str) -> dict:
    """One run of ``rule`` (see the module docstring); its round records, summarised."""
    bundle = load_dataset("digits")
    net = MemoryNetwork()
    me = _ctx(net, "me", data=node_data_for(bundle, 2, 0, "iid", seed=0), train=TrainConfig(steps=1),
              model_spec=default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small"))
    me.straggler = StragglerPolicy("quorum")
    me.catch_up, me.final_round = True, FINAL
    me.max_catch_up_rounds = FINAL if rule == "uncapped" else CAP
    if rule == "capped-wait":
        me.membership.__class__ = type("NoTakeAhead", (type(me.membership),), {
            "behind": property(lambda self: False, lambda self, value: None)})
    peers = [_ctx(net, n, data=None, model_spec={}, train=None) for n in ("a", "b")]
    fedavg = get_algorithm("fedavg")
    records: list[dict] = []
    node = Node(me, fedavg(me, quorum_options(fedavg.Options(round_timeout=ROUND_TIMEOUT), me.straggler)),
                bundle.test.x[:50], bundle.test.y[:50], sink=records.append)

    async def main() -> float:
        for c in (me, *peers):
            await c.start()
        await node.setup()
        model = model_to_numpy(node.algorithm.model)
        me.check_on_arrival("model", arrival_check(model))
        node.state = "running"

        async def federation() -> None:
            for r in range(AHEAD + 1, FINAL + 1):
                for p in peers:
                    await p.send("me", Message("model", r, dict(model), meta={"samples": 10}))
                await asyncio.sleep(PERIOD)

        task = asyncio.ensure_future(federation())
        t0 = me.clock.now()
        await node.run(FINAL)
        task.cancel()
        return me.clock.now() - t0

    seconds = run_virtual(main())
    rounds = [(r["round"], r["neighbours"], round(r["round_seconds"], 1)) for r in records]
    return {"rule": rule, "rounds_run": len(rounds), "rounds_alone": sum(1 for _, n, _ in rounds if n == 0),
            "rounds_skipped": me.caught_up, "virtual_seconds": round(seconds, 1),
            "first_rounds": rounds[:8]}  # (round, neighbours used, seconds)


if __name__ == "__main__":
    out = {"setup": {"ahead": AHEAD, "final_round": FINAL, "neighbour_round_seconds": PERIOD,
                     "max_catch_up_rounds": CAP, "round_timeout": ROUND_TIMEOUT,
                     "algorithm": "fedavg", "straggler": "quorum", "data": "digits", "clock": "virtual"},
           "runs": [run(rule) for rule in sys.argv[1:] or ("uncapped", "capped-wait", "capped")]}
    print(json.dumps(out, indent=1))
