"""An in-process :class:`~dfl_agent.runtime.shared.run_host.RunHost` for tests that drive a training
:class:`~dfl_agent.runtime.run.agent.Agent` in the test's own process (no run process, no pipe).

:class:`LobbyHost` is what the supervisor is to a run process, cut to what a test needs: the
service's own :class:`~dfl_agent.runtime.service.lobby.RunLobby` signs and publishes the node's
presence and status on its own MQTT session (so peers find and verify the node as they find a
supervised one), and the run's states after its rounds are recorded in :attr:`LobbyHost.states`.
Without a broker (``publish=False``) nothing is published: a unit test that never connects.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dfl_agent.runtime.shared.pipe import StateReport, StatusReport


class LobbyHost:
    """A test's :class:`~dfl_agent.runtime.shared.run_host.RunHost`.

    Args:
        cfg: the node's configuration (its broker, keys and federation).
        members: the run's admitted members besides this node.
        may_join: how many other nodes may still join.
        publish: publish the node's presence and status through a lobby (needs the broker).
    """

    def __init__(self, cfg: Any = None, *, members: tuple[str, ...] | set[str] = (), may_join: int = sys.maxsize,
                 publish: bool = True):
        self.cfg, self._members, self._may_join = cfg, tuple(sorted(members)), may_join
        self.publish = publish and cfg is not None
        self.states: list[StateReport] = []
        self.statuses: list[StatusReport] = []
        self.lobby: Any = None

    def _lobby(self) -> Any:
        """The lobby, started on first use (the node id and keys exist by then)."""
        if self.lobby is None:
            from dfl_agent.runtime.service.lobby import RunLobby
            from dfl_agent.runtime.shared.assembly import build_security
            from dfl_agent.runtime.shared.descriptor import RunVerifier
            from dfl_agent.runtime.shared.run_config import node_id_from_state

            cfg = self.cfg
            nid = node_id_from_state(Path(cfg.state_dir), cfg.node_id)
            guard = build_security(cfg, Path(cfg.state_dir), nid)
            lobby = RunLobby(cfg, nid, RunVerifier(cfg.federation, require_signatures=cfg.security.require_signatures,
                                                   guard=guard), guard=guard)
            lobby.start()
            lobby.connected.wait(30)
            self.lobby = lobby
        return self.lobby

    def stop(self) -> None:
        """Say the node left (a signed "offline") and disconnect the lobby."""
        if self.lobby is not None:
            self.lobby.publish_presence(None, "stopping")
            self.lobby.stop()

    # -- RunHost ----------------------------------------------------------------------------
    def members(self) -> tuple[str, ...]:
        return self._members

    def may_join(self) -> int:
        return self._may_join

    def publish_presence(self, descriptor: Mapping[str, Any]) -> None:
        if self.publish:
            self._lobby().publish_presence(dict(descriptor))

    def leave(self) -> None:
        if self.publish and self.lobby is not None:
            self.lobby.publish_presence(None, "run ended")

    def publish_status(self, report: StatusReport) -> None:
        self.statuses.append(report)
        if self.publish:
            self._lobby().publish_run_status(report.status)

    def record_state(self, report: StateReport) -> None:
        self.states.append(report)
