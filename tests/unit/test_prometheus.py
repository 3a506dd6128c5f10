"""The optional Prometheus endpoint serves a node's rounds, bytes, accuracy, dropped
messages and peers."""

import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from dfl_agent.algorithms.base import get_algorithm  # noqa: E402
from dfl_agent.data import load_dataset, node_data_for  # noqa: E402
from dfl_agent.discovery.peers import PeerTable  # noqa: E402
from dfl_agent.learning.training import TrainConfig  # noqa: E402
from dfl_agent.models import default_spec  # noqa: E402
from dfl_agent.runtime.node.context import RuntimeContext  # noqa: E402
from dfl_agent.runtime.node.node import Node  # noqa: E402
from dfl_agent.runtime.service.prometheus import PrometheusExporter, ServiceCollector  # noqa: E402
from dfl_agent.runtime.service.supervisor import RunProgress  # noqa: E402
from dfl_agent.runtime.shared.pipe import RunCounters  # noqa: E402
from dfl_agent.transport.memory import MemoryNetwork, run_virtual  # noqa: E402


def test_metrics_endpoint():
    bundle = load_dataset("digits")
    spec = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    net = MemoryNetwork()
    ctx = RuntimeContext(node_id="p0", federation="f", transport=net.transport("p0", "f", {}),
                         peers=PeerTable("p0", "f"), data=node_data_for(bundle, 1, 0, "iid", seed=0),
                         model_spec=spec, train=TrainConfig(), init_seed=1, rng=np.random.default_rng(0))
    node = Node(ctx, get_algorithm("local")(ctx), bundle.test.x[:100], bundle.test.y[:100], rounds=2)
    ctx.rejected["malformed"] += 3

    async def main():
        await ctx.start()
        await node.setup()
        await node.run(2)
        await ctx.stop()

    run_virtual(main())
    # what the service knows of the node from its run process's status report
    c = ctx.counters()
    progress = RunProgress("p0", "f", node.status(), RunCounters(c["bytes_sent"], c["bytes_received"], c["dropped"],
                                                                 c["diverged"]), tuple(ctx.live_peers()), 2)
    collector = ServiceCollector("p0", "f", lambda: progress, lambda: {"state": "training", "run": None})
    exp = PrometheusExporter(0, "127.0.0.1", collector).start()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10).read().decode()
    finally:
        exp.stop()
    lines = {ln.split(" ")[0]: ln.split(" ")[-1] for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert float(lines["dfl_round"]) == 2 and float(lines["dfl_rounds_planned"]) == 2
    assert 0 < float(lines['dfl_accuracy{split="global"}']) <= 1
    assert float(lines['dfl_dropped_messages_total{reason="malformed"}']) == 3
    assert "dfl_bytes_sent_total" in lines and "dfl_peers_live" in lines
    assert float(lines["dfl_rounds_alone_total"]) == 0  # nobody else: no peer was expected
    assert float(lines["dfl_checkpoint_round"]) == 2
    assert 'dfl_node_info{algorithm="local",federation="f",node="p0",state="finished"}' in lines
