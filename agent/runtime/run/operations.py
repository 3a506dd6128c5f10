"""The training agent's operations: its checkpoints and SIGHUP reload (:class:`AgentOperations`,
a part of :class:`~dfl_agent.runtime.run.agent.Agent`).  systemd and the Prometheus endpoint are the
service's (:mod:`dfl_agent.runtime.service.daemon`, :mod:`dfl_agent.runtime.service.supervisor`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.node.checkpoint import CheckpointStore, NodeCheckpointer
from dfl_agent.runtime.node.metrics import written_rounds
from dfl_agent.runtime.run.reload import reload_config
from dfl_agent.runtime.shared.degraded import peer_updates_used

log = logging.getLogger("dfl_agent.daemon")


class AgentOperations:
    """Checkpoints and reload for :class:`~dfl_agent.runtime.run.agent.Agent` (which sets the
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
        (:func:`~dfl_agent.runtime.run.reload.reload_config`).  Returns the keys applied."""
        return reload_config(self)


def recount(path: Path | None, node_id: str, run_id: str | None, upto: int,
            max_bytes: int = 64 << 20) -> tuple[int, int]:
    """``(rounds_alone, exchange_rounds)`` of ``node_id``'s records of rounds ``<= upto`` in
    run ``run_id`` (None: outside runs) in the metrics file ``path``: what a resumed node
    counted before its restart.  Torn, foreign and repeated lines count once or not at all."""
    alone: set[int] = set()
    exchange: set[int] = set()
    try:
        with open(path or "", "rb") as f:
            lines = f.read(max_bytes).splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        try:
            rec = bounded_loads(line, max_bytes=max_bytes)
        except ValueError:
            continue
        if not (isinstance(rec, dict) and rec.get("node") == node_id and rec.get("run") == run_id
                and isinstance(t := rec.get("round"), int) and 1 <= t <= upto):
            continue
        if rec.get("alone") is True:
            alone.add(t)
        if rec.get("alone") is True or peer_updates_used(rec) is not None:
            exchange.add(t)
    return len(alone), len(exchange)
