"""Optional Prometheus endpoint of the daemon (``runtime.prometheus_port``).

Needs the ``metrics`` extra (``prometheus_client``).  The service serves it; the values are
read at scrape time by a custom collector from what the service knows of the run's node (its
last reported status and counters, :class:`~dfl_agent.runtime.service.supervisor.RunProgress`), so
nothing has to be updated on the learning path and a scrape always sees one consistent view.  Metrics (all labelled by nothing but what is listed):

- ``dfl_node_info{node,federation,algorithm}`` = 1
- ``dfl_round`` (gauge): last completed round; ``dfl_rounds_planned`` (gauge)
- ``dfl_bytes_sent_total``, ``dfl_bytes_received_total`` (counters, bytes on the wire)
- ``dfl_accuracy{split="global"|"local"}`` (gauge, fraction in [0, 1]) of the
  deployable model at the last evaluated round
- ``dfl_dropped_messages_total{reason}`` (counter): messages dropped by reason
- ``dfl_rounds_alone_total`` (counter): rounds closed with no peer update although
  neighbours were expected or needed (the status's ``rounds_alone``: a degraded run)
- ``dfl_peers_live`` (gauge): peers currently live
- ``dfl_checkpoint_round`` (gauge), ``dfl_checkpoint_errors_total`` (counter)

An always-on agent (``dfl-agent run`` without ``--once``) serves one endpoint for its
whole life through :class:`ServiceCollector`: while a run trains it shows that run's
node as above plus ``dfl_run_info{run,state}``; while idle ``dfl_node_info`` has
``state="idle"`` (or the last run's state), ``dfl_round`` is 0, and
``dfl_runs_refused_total{reason}`` counts refused run descriptors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


def node_metrics(node: Any) -> Iterable[Any]:
    """The metrics of a run's node (see the module docstring) from what the service knows of it
    (:class:`~dfl_agent.runtime.service.supervisor.RunProgress`): its status, its counters
    (:class:`~dfl_agent.runtime.shared.pipe.RunCounters`), its live peers and the round of its
    last checkpoint."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    st, counters = node.status, node.counters
    yield InfoMetricFamily("dfl_node", "this node", value={
        "node": str(node.node_id), "federation": str(node.federation),
        "algorithm": str(st.get("algorithm", "")), "state": str(st.get("state", ""))})
    yield GaugeMetricFamily("dfl_round", "last completed round", value=float(st.get("round") or 0))
    yield GaugeMetricFamily("dfl_rounds_planned", "rounds planned", value=float(st.get("rounds") or 0))
    yield CounterMetricFamily("dfl_bytes_sent", "bytes sent on the wire", value=float(counters.bytes_sent))
    yield CounterMetricFamily("dfl_bytes_received", "bytes received on the wire", value=float(counters.bytes_received))
    acc = GaugeMetricFamily("dfl_accuracy", "accuracy of the deployable model (fraction)", labels=["split"])
    for split in ("global", "local"):
        v = st.get(f"{split}_accuracy")
        if isinstance(v, (int, float)):
            acc.add_metric([split], float(v))
    yield acc
    dropped = CounterMetricFamily("dfl_dropped_messages", "messages dropped, by reason", labels=["reason"])
    for reason, n in sorted(dict(counters.dropped).items()):
        dropped.add_metric([str(reason)], float(n))
    yield dropped
    yield CounterMetricFamily("dfl_diverged_steps", "aggregation, mutual-learning or transfer steps that left "
                              "a non-finite model (restored)", value=float(counters.diverged))
    yield CounterMetricFamily("dfl_rounds_alone", "rounds closed with no peer update although "
                              "neighbours were expected or needed", value=float(st.get("rounds_alone") or 0))
    yield GaugeMetricFamily("dfl_peers_live", "live peers", value=float(len(node.live_peers)))
    yield GaugeMetricFamily("dfl_checkpoint_round", "round of the last checkpoint written",
                            value=float(node.checkpoint_round))
    yield CounterMetricFamily("dfl_checkpoint_errors", "failed checkpoint writes",
                              value=float(st.get("checkpoint_errors") or 0))


class ServiceCollector:
    """The collector of an always-on agent: the training node's metrics while a run
    trains, the idle service's otherwise.

    Args:
        node_id, federation: this node.
        current: returns what the service knows of the node of the run in training
            (:class:`~dfl_agent.runtime.service.supervisor.RunProgress`), or None while idle.
        service: returns the idle view, ``{"state": str, "run": {id, state, round, reason}
            | None, "runs_refused": {reason: n}}``.
    """

    def __init__(self, node_id: str, federation: str, current: Callable[[], Any], service: Callable[[], dict[str, Any]]):
        self.node_id, self.federation = node_id, federation
        self.current, self.service = current, service

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        view = self.service()
        node = self.current()
        run = view.get("run") if isinstance(view.get("run"), dict) else None
        if node is not None:
            yield from node_metrics(node)
        else:
            yield InfoMetricFamily("dfl_node", "this node", value={
                "node": self.node_id, "federation": self.federation, "algorithm": "",
                "state": str(view.get("state", "idle"))})
            yield GaugeMetricFamily("dfl_round", "last completed round", value=0.0)
        if run is not None:
            yield InfoMetricFamily("dfl_run", "the current or last run on this node",
                                   value={"run": str(run.get("id", "")), "state": str(run.get("state", ""))})
        refused = CounterMetricFamily("dfl_runs_refused", "run descriptors refused, by reason", labels=["reason"])
        for reason, n in sorted(dict(view.get("runs_refused") or {}).items()):
            refused.add_metric([str(reason)], float(n))
        yield refused


class PrometheusExporter:
    """Serves ``/metrics`` for one node on ``address:port`` (own registry, own thread) from
    ``collector`` (a :class:`ServiceCollector`).

    Raises:
        ImportError: ``prometheus_client`` is not installed (see :func:`dfl_agent.extras.extra_hint`).
        OSError: the port is taken.
    """

    def __init__(self, port: int, address: str, collector: Any):
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            from dfl_agent.extras import extra_hint

            raise ImportError(f"runtime.prometheus_port needs prometheus_client: {extra_hint('metrics')}") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.port, self.address = port, address
        self._server: Any = None

    def start(self) -> PrometheusExporter:
        from prometheus_client import start_http_server

        result = start_http_server(self.port, addr=self.address, registry=self.registry)
        self._server = result[0] if isinstance(result, tuple) else None
        if self._server is not None:
            self.port = self._server.server_address[1]
        log.info("Prometheus metrics on http://%s:%d/metrics", self.address, self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
