"""SIGHUP: apply a changed configuration file to a running training agent (the supervisor
checks the file, tells systemd, and has its run process apply it: :meth:`RunManager.reload
<dfl_agent.runtime.service.run_manager.RunManager.reload>`).

What can change while running is applied (``runtime.log_level``,
``discovery.static_peers``, ``discovery.heartbeat_timeout``); other changes are logged
as needing a restart; a bad file changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from dfl_agent.discovery.static import load_static_peers, parse_peer
from dfl_agent.runtime.shared.config import ConfigError, NodeConfig, load_config

log = logging.getLogger("dfl_agent.daemon")


def reload_config(agent: Any) -> list[str]:
    """SIGHUP: re-read ``agent``'s configuration file and apply what can change while
    running — ``runtime.log_level``, ``discovery.static_peers`` (new ones added,
    removed ones withdrawn) and ``discovery.heartbeat_timeout``.  Other changes are
    logged as needing a restart.  A bad file changes nothing.  Returns the keys applied."""
    if not agent.config_path:
        return []
    try:
        new = load_config(agent.config_path)
    except ConfigError as exc:
        log.error("reload: configuration error, keeping the running one: %s", exc)
        return []
    old, applied = agent.cfg, []
    if new.runtime.log_level != old.runtime.log_level:
        logging.getLogger().setLevel(getattr(logging, new.runtime.log_level.upper()))
        applied.append("runtime.log_level")
    if agent.peers is not None and new.discovery.static_peers != old.discovery.static_peers:
        try:
            keep = {parse_peer(e)["node_id"] for e in new.discovery.static_peers}
            load_static_peers(agent.peers, new.discovery.static_peers, agent.cfg.federation)
            for e in old.discovery.static_peers:
                if parse_peer(e)["node_id"] not in keep:
                    agent.peers.withdraw(parse_peer(e)["node_id"], "static")
            applied.append("discovery.static_peers")
        except ValueError as exc:
            log.error("reload: discovery.static_peers: %s", exc)
    if agent.peers is not None and new.discovery.heartbeat_timeout != old.discovery.heartbeat_timeout:
        agent.peers.heartbeat_timeout = new.discovery.heartbeat_timeout
        applied.append("discovery.heartbeat_timeout")
    a, b = _flat(old), _flat(new)
    later = [k for k in b if a.get(k) != b[k] and k not in applied]
    for sec in ("runtime", "discovery"):
        setattr(agent.cfg, sec, getattr(new, sec))
    log.info("reloaded %s: applied %s%s", agent.config_path, ", ".join(applied) or "nothing",
             f"; needs a restart: {', '.join(later)}" if later else "")
    return applied


def _flat(c: NodeConfig) -> dict[str, Any]:
    """``section.key -> value`` of a configuration (top-level values under their own name)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        items = (dataclasses.asdict(v).items() if dataclasses.is_dataclass(v) and not isinstance(v, type)
                 else [(None, v)])
        out.update({f"{f.name}.{k}" if k else f.name: x for k, x in items})
    return out
