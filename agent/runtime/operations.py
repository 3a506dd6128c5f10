"""The agent's operations: its checkpoints, its line in ``systemctl status``, the systemd
watchdog, the Prometheus endpoint and SIGHUP reload (:class:`AgentOperations`, a part of
:class:`~dfl_agent.runtime.agent.Agent`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dfl_agent.runtime.checkpoint import CheckpointStore, NodeCheckpointer
from dfl_agent.runtime.degraded import recount
from dfl_agent.runtime.metrics import written_rounds
from dfl_agent.runtime.prometheus import PrometheusExporter
from dfl_agent.runtime.reload import reload_config
from dfl_agent.runtime.systemd import status_loop, watchdog_loop

log = logging.getLogger("dfl_agent.daemon")


class AgentOperations:
    """Checkpoints, systemd and Prometheus for :class:`~dfl_agent.runtime.agent.Agent`
    (which sets the attributes used here: ``cfg``, ``node``, ``ctx``, ``notifier``,
    ``run_desc``, ``run_dir``, ``state_dir``, ``metrics_path``, ``metrics_run``,
    ``node_id``, ``serving``, ``checkpointer``)."""

    cfg: Any
    node: Any
    ctx: Any
    notifier: Any
    run_desc: Any
    run_dir: Any
    state_dir: Any
    metrics_path: Any
    metrics_run: Any
    node_id: str
    serving: bool
    checkpointer: Any

    def _resume(self, model_hash: str) -> int:
        """Restore the newest usable checkpoint (``{state_dir}/checkpoints``) and hook
        a checkpoint after every round.  Returns the first round to run."""
        if not self.cfg.runtime.checkpoint:
            return 1
        where = (self.run_dir or self.state_dir) / "checkpoints"  # runs: checkpoints per run
        store = CheckpointStore(where, keep=self.cfg.runtime.checkpoint_keep)
        self.checkpointer = ck = NodeCheckpointer(store, self.node.algorithm, self.ctx, model_hash,
                                                  pending=self.node.pending_records)
        restored = ck.restore()
        if restored and ck.restored_pending:  # records that a kill kept from the metrics file
            written = written_rounds(self.metrics_path, self.node_id, self.metrics_run, min(
                int(r["round"]) for r in ck.restored_pending))
            self.node.recover_records(restored, ck.restored_pending, written)
        if restored:
            self.node.history.append({"node": self.node_id, "round": restored, "time": self.ctx.clock.now(),
                                      "resumed": True})
            log.info("resuming at round %d (restored state digest %s)", restored + 1, ck.restored_digest)
            self.node.rounds_alone, self.node.exchange_rounds = recount(  # a degraded run stays degraded
                self.metrics_path, self.node_id, self.metrics_run, restored)
        self.node.checkpoint = ck.save_async
        return restored + 1

    def status_line(self) -> str:
        """One line for ``systemctl status`` (STATUS=): round, role, peers."""
        st = self.node.status() if self.node is not None else {}
        prefix = f"run {self.run_desc.run_id} " if self.run_desc is not None else ""
        return (f"{prefix}{st.get('state', 'starting')}: round {st.get('round', 0)}/{st.get('rounds', 0)}, "
                f"role {st.get('role', 'peer')}, {len(st.get('live_peers', []))} peers")

    def _start_systemd(self) -> asyncio.Task[None] | None:
        """READY=1 with a STATUS, then WATCHDOG pings from the event loop."""
        n = self.notifier
        n.ready(self.status_line())
        interval = n.watchdog_interval()
        if not n.enabled:
            return None
        return asyncio.ensure_future(watchdog_loop(n, interval or 5.0, self.status_line)) if interval else \
            asyncio.ensure_future(status_loop(n, self.status_line))

    def _start_prometheus(self) -> Any:
        port = self.cfg.runtime.prometheus_port
        if not port or self.serving:  # an always-on agent serves one endpoint for its whole life
            return None
        try:
            return PrometheusExporter(self.node, port, self.cfg.runtime.prometheus_address,
                                      checkpoint_round=lambda: getattr(self.checkpointer, "last_saved", 0)).start()
        except (ImportError, OSError) as exc:
            log.error("Prometheus endpoint disabled: %s", exc)
            return None

    def reload(self) -> list[str]:
        """SIGHUP: re-read the configuration file and apply what can change while running
        (:func:`~dfl_agent.runtime.reload.reload_config`).  Returns the keys applied."""
        return reload_config(self)
