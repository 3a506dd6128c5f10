"""Answering a member that missed a run's end: the service's side of the model hand-over.

A device that comes back after its run's members finished the run asks them, one at a time,
for the model they deployed of that run: its status (signed, retained) says
``model_wanted: {"run_id", "from", "nonce", "round"}``
(:mod:`dfl_agent.runtime.shared.model_handover`).  The service of the member asked answers each
such request once (per nonce), whether it trains another run or idles: it sends one
``model.files`` frame, signed with its key and chunked, to the requester's inbox, holding the
files of its newest version of that run (``models/vN/model.safetensors`` and ``spec.json``, their
hashes checked against the version's manifest), or, where it holds none, why (deployment off,
the model kept by its deploy gate, the version pruned, the run not finished here).

Only statuses the run lobby verified count (with ``security.require_signatures``: signed by an
enrolled device), and only fresh ones (sent less than :data:`MAX_AGE_S` ago).  A requester gets
at most one answer per :data:`MIN_INTERVAL_S`, so a device that keeps changing its nonce cannot
take the node's upload.  Torch-free: the service never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dfl_agent.jsonbound import RateLimitedLog
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.service.member_delivery import send_frame, tick_every
from dfl_agent.runtime.shared.model_handover import asked, files_message

log = logging.getLogger("dfl_agent.daemon")
_ERRORS = RateLimitedLog(log)

#: seconds between two checks of the peers' statuses
PERIOD_S = 0.5
#: a request in a status sent longer ago than this (s) is not answered (the requester is gone)
MAX_AGE_S = 120.0
#: seconds between two answers to one requester, at least (as between two copies of a model to an
#: inference member: :mod:`~dfl_agent.runtime.service.member_delivery`)
MIN_INTERVAL_S = 15.0


class ModelHandover:
    """Answer the peers whose status asks this node for a run's model (see the module docstring).

    Args:
        cfg: the node's :class:`~dfl_agent.runtime.shared.config.NodeConfig` (``state_dir``,
            ``deploy``, ``mqtt``).
        lobby: the node's :class:`~dfl_agent.runtime.service.lobby.RunLobby`: its MQTT session, the
            peers' verified statuses, the node's signing guard and its run ledger.
        clock: monotonic seconds (tests).
    """

    def __init__(self, cfg: Any, lobby: Any, *, clock: Callable[[], float] = time.monotonic):
        from dfl_agent.deploy.versions import ModelStore
        from dfl_agent.transport.link_rate import derive

        self.cfg, self.lobby, self.clock = cfg, lobby, clock
        self.models = ModelStore(cfg.state_dir, keep=cfg.deploy.keep)
        m = cfg.mqtt
        self.chunk_size = derive(m.link_rate, chunk_size=m.chunk_size, keepalive=m.keepalive).chunk_size
        #: requester -> (the nonce last answered, when)
        self.answered: dict[str, tuple[str, float]] = {}
        #: answers sent, by kind: ``files`` (a version's files) and ``missing`` (why none)
        self.answers: dict[str, int] = {"files": 0, "missing": 0}

    def due(self) -> list[tuple[str, dict[str, Any]]]:
        """The requests to answer now: ``(requester, request)`` in node order."""
        with self.lobby.lock:
            statuses = {n: dict(s) for n, s in self.lobby.statuses.items() if isinstance(s, dict)}
        now, wall, out = self.clock(), time.time(), []
        for node, st in sorted(statuses.items()):
            req = asked(st, self.lobby.node_id)
            sent = st.get("time")
            if req is None or st.get("state") == "stopped" or isinstance(sent, bool) or \
                    not isinstance(sent, (int, float)) or abs(wall - float(sent)) > MAX_AGE_S:
                continue
            last = self.answered.get(node)
            if last is not None and (last[0] == req["nonce"] or now - last[1] < MIN_INTERVAL_S):
                continue
            out.append((node, req))
        return out

    def why_none(self, run_id: str) -> str:
        """Why this node holds no version of ``run_id``'s model (one line for the requester)."""
        cfg = self.cfg
        if not cfg.deploy.enabled:
            return "deployment is off on this device (deploy.enabled = false)"
        if not cfg.deploys:
            return "this device deploys no model (its data is not the sample store)"
        cand = self.models.root / "candidate" / "manifest.json"
        try:
            staged = bounded_loads(cand.read_bytes(), "manifest") if cand.is_file() else None
        except (OSError, ValueError):
            staged = None
        if isinstance(staged, dict) and staged.get("run_id") == run_id:
            return f"its deploy gate kept the model it had ({str(staged.get('note') or '')[:200]})"
        ledger = getattr(self.lobby, "ledger", None)
        entry = ledger.entries.get(run_id) if ledger is not None else None
        if not isinstance(entry, dict):
            return "it has no record of the run"
        if entry.get("state") != "finished":
            return f"the run is {entry.get('state')} there"
        if entry.get("model") == "kept":
            return f"its deploy gate kept the model it had ({str(entry.get('model_note') or '')[:200]})"
        return "no version of the run is kept there (deploy.keep)"

    def tick(self) -> int:
        """Answer the requests that are due; returns how many were answered."""
        if self.lobby.client is None or not self.lobby.up():
            return 0
        done = 0
        for node, req in self.due():
            rid = req["run_id"]
            msg = files_message(self.models, rid, req["nonce"], req["round"], max_bytes=self.cfg.mqtt.max_frame_bytes
                                - (1 << 16), why_none=self.why_none(rid))
            size = send_frame(self.lobby, self.cfg.federation, node, msg, self.chunk_size)
            self.answered[node] = (req["nonce"], self.clock())
            if msg.tensors:
                self.answers["files"] += 1
                log.info("sent the model of run %s (v%s, %d bytes) to %s, which missed the run's end", rid,
                         msg.meta.get("version"), size, node)
            else:
                self.answers["missing"] += 1
                log.info("told %s that this node holds no model of run %s: %s", node, rid, msg.meta["missing"])
            done += 1
        return done

    async def run(self, stop: asyncio.Event, period: float = PERIOD_S) -> None:
        """:meth:`tick` every ``period`` seconds until ``stop``; an error is logged (rate-limited)
        and the loop goes on (an answer is best effort; the requester asks another member)."""
        await tick_every(self.tick, stop, period, _ERRORS, "could not answer a request for a run's model")
