"""The training agent's operations: its checkpoints and SIGHUP reload (:class:`AgentOperations`,
a part of :class:`~dfl_agent.runtime.agent.Agent`).  systemd and the Prometheus endpoint are the
service's (:mod:`dfl_agent.runtime.daemon`, :mod:`dfl_agent.runtime.supervisor`)."""

from __future__ import annotations

import logging
from typing import Any

from dfl_agent.runtime.checkpoint import CheckpointStore, NodeCheckpointer
from dfl_agent.runtime.degraded import recount
from dfl_agent.runtime.metrics import written_rounds
from dfl_agent.runtime.reload import reload_config

log = logging.getLogger("dfl_agent.daemon")


class AgentOperations:
    """Checkpoints and reload for :class:`~dfl_agent.runtime.agent.Agent` (which sets the
    attributes used here: ``cfg``, ``node``, ``ctx``, ``run_desc``, ``run_dir``, ``state_dir``,
    ``metrics_path``, ``metrics_run``, ``node_id``, ``checkpointer``)."""

    cfg: Any
    node: Any
    ctx: Any
    run_desc: Any
    run_dir: Any
    state_dir: Any
    metrics_path: Any
    metrics_run: Any
    node_id: str
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
            log.info("resuming at round %d (restored state digest %s)", restored + 1, ck.restored_digest)
            self.node.resumed_at(restored, *recount(  # a degraded run stays degraded
                self.metrics_path, self.node_id, self.metrics_run, restored))
        return restored + 1

    def reload(self) -> list[str]:
        """SIGHUP: re-read the configuration file and apply what can change while running
        (:func:`~dfl_agent.runtime.reload.reload_config`).  Returns the keys applied."""
        return reload_config(self)
