"""RuntimeContext is a façade over its parts: inbox, outbox, membership, compute gate.
The parts' state stays readable under the context's names, and one frame pipeline
serves raw frames and frames prepared off the loop alike."""

import asyncio

import numpy as np

from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.runtime.node.compute_gate import ComputeGate
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.inbox import Inbox, PreparedFrame
from dfl_agent.runtime.node.membership import Membership
from dfl_agent.runtime.node.outbox import Outbox
from dfl_agent.transport import wire
from dfl_agent.transport.memory import MemoryNetwork


def _ctx(nid="b", **kw):
    net = MemoryNetwork()
    return RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
                          data=None, model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0), **kw)


def test_the_context_is_made_of_its_parts():
    ctx = _ctx(compatibility=lambda info: "different model")
    assert isinstance(ctx.inbox, Inbox) and isinstance(ctx.outbox, Outbox)
    assert isinstance(ctx.membership, Membership) and isinstance(ctx.gate_part, ComputeGate)
    ctx.peers.upsert("a", "presence")
    assert ctx.live_peers() == [] and ctx.excluded == {"a": "different model"}
    assert ctx.excluded is ctx.membership.excluded and ctx.rejected["incompatible_peer"] == 1
    assert ctx.latest_round is ctx.inbox.latest_round and ctx.gated is None and ctx.abort is None


def test_one_pipeline_for_raw_and_prepared_frames():
    ctx = _ctx()

    def frame(rnd):
        return wire.encode(Message("model", rnd, {"w": np.ones(3, np.float32)}), federation="f", sender="a")

    async def main():
        await ctx.start()
        raw, other = frame(1), frame(2)
        ctx._on_frame(raw, len(raw))
        prepared = ctx.prepare_frame(other, len(other))
        assert isinstance(prepared, PreparedFrame) and prepared.error is None
        ctx._on_frame(prepared, len(other))
        ctx._on_frame(raw, len(raw))  # the same message again: a duplicate either way
        ctx._on_frame(ctx.prepare_frame(other, len(other)), len(other))
        got = [await ctx.receive("model", round=r, deadline=0.0) for r in (1, 2)]
        assert [m.round for m in got] == [1, 2] and ctx.rejected["duplicate"] == 2
        assert ctx.byte_accounting()["bytes_received_by_kind"] == {"model": len(raw) + len(other)}
        await ctx.stop()

    asyncio.run(main())


def test_a_flood_of_bad_messages_is_counted_exactly_and_logged_a_few_times(caplog, monkeypatch):
    """1,000 drops from one sender for one reason: all counted, 5 lines logged, and after a
    minute one more line that says how many were not logged; another sender is logged anew."""
    import logging

    from dfl_agent.runtime.node import inbox as inbox_module

    ctx = _ctx()
    now = [100.0]
    monkeypatch.setattr(inbox_module.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="dfl_agent.runtime.node.context"):
        for _ in range(1000):
            ctx.inbox.drop("choco_gap", "out of sequence", sender="a")
        assert ctx.rejected["choco_gap"] == 1000
        assert len(caplog.records) == 5
        now[0] += 61.0
        ctx.inbox.drop("choco_gap", "out of sequence", sender="a")
        ctx.inbox.drop("choco_gap", "out of sequence", sender="b")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 7 and lines[5].endswith("(995 more from a not logged)"), lines[5:]
    assert lines[6] == "dropped message from b: choco_gap out of sequence"
    assert ctx.rejected["choco_gap"] == 1002
