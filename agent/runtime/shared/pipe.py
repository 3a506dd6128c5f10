"""The typed pipe between the supervisor and a run process.

The supervisor (:mod:`dfl_agent.runtime.service.supervisor`) and the run process
(:mod:`dfl_agent.runtime.run.run_process`) exchange JSON lines, one message per line, and
nothing else: this module is all they share besides the configuration.  Every message is a
frozen dataclass; :func:`to_line` writes one, :func:`from_line` reads one back and raises
:class:`PipeError` for anything that is not a message of this module (the reader drops it
and goes on).  Torch-free.

Supervisor -> run process (the run process's standard input):

* :class:`Start` first: the run's admitted members besides this node, and how many other
  nodes may still join it;
* :class:`Ack` once the supervisor recorded a :class:`StateReport` (and, for ``deployed``,
  switched ``current`` to the installed version);
* :class:`MayJoin` whenever the number of nodes that may still join changes;
* :class:`Reload` after a SIGHUP (the run re-reads what can change while it runs).

Run process -> supervisor (the run process's original standard output):

* :class:`Presence`: the node's presence descriptor, which the supervisor signs and
  publishes (the run process publishes no presence, no status and no last will);
* :class:`Goodbye`: the node leaves the run's rounds (the supervisor says "offline" at once);
* :class:`StatusReport`: the node's status with its counters, live peers and the round of
  its last checkpoint (the supervisor signs and publishes the status, with the service's
  counters);
* :class:`StateReport`: a state of the run after its rounds (``trained``, ``deploying``,
  ``deployed`` with the installed version, ``kept``; ``adopted`` with the installed version of
  a model another member deployed, for a node that missed the run's end); the run process
  waits for its :class:`Ack`;
* :class:`Failure`: why the run cannot start (``startup``) or crashed (``crash``);
* :class:`End`, last: how the run ended here (``missed`` with its reason: the run ended on its
  members while this node was away, and no member could provide its model).

The JSON of each message is the one the pipe carried before it was typed (``{"type": ...}``
with the same fields), so a supervisor and a run process of the same release agree by
construction and the lines stay readable in a log.  Fields added later are optional: a line
without them (an earlier release's) reads as before.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads

#: the longest line either side reads (bytes); a longer one is dropped by the reader
MAX_LINE_BYTES = 1 << 22
#: "no limit" for :attr:`Start.may_join` and :class:`MayJoin`
UNBOUNDED = sys.maxsize
#: the run's states after its rounds that a :class:`StateReport` carries
AFTER_ROUNDS = ("trained", "deploying", "deployed", "kept", "adopted")
#: how a run ends in a run process (:class:`End`): ``missed``: it ended on its members while this
#: node was away, and no member could provide the run's model
OUTCOMES = ("finished", "stopped", "missed")
#: the kinds of :class:`Failure`
FAILURES = ("startup", "crash")
#: the degraded-run fields a state report may carry (:mod:`dfl_agent.runtime.shared.degraded`)
DEGRADED_KEYS = ("degraded", "rounds_alone", "exchange_rounds")

JSON = dict[str, Any]
#: a run node's drop counters that the service keeps (the lobby counts the statuses itself)
RUN_KEEPS = ("presence_", "bad_presence", "model_files_")


def run_drops(dropped: Mapping[str, int] | None) -> dict[str, int]:
    """The drops of a run's node (``dropped``: reason -> count) that the service keeps
    (:data:`RUN_KEEPS`), ``{}`` for None."""
    return {k: int(v) for k, v in dict(dropped or {}).items() if k.startswith(RUN_KEEPS)}


class PipeError(ValueError):
    """A line that is not a message of the pipe (its text names why)."""


def _int(doc: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PipeError(f"{key}: an integer expected, got {v!r}")
    return v


def _opt_int(doc: Mapping[str, Any], key: str) -> int | None:
    return None if doc.get(key) is None else _int(doc, key)


def _opt_mb(doc: Mapping[str, Any], key: str) -> float | None:
    """A size in MiB (a non-negative finite number), or None where the line has none."""
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise PipeError(f"{key}: a size in MiB expected, got {v!r}")
    return float(v)


def _opt_str(doc: Mapping[str, Any], key: str) -> str | None:
    """A text field, or None where the line has none."""
    v = doc.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise PipeError(f"{key}: a string expected, got {type(v).__name__}")
    return v


def _dict(doc: Mapping[str, Any], key: str, default: JSON | None = None) -> JSON:
    v = doc.get(key, default)
    if not isinstance(v, dict):
        raise PipeError(f"{key}: an object expected")
    return dict(v)


def _strs(doc: Mapping[str, Any], key: str) -> tuple[str, ...]:
    v = doc.get(key) or []
    if not isinstance(v, list):
        raise PipeError(f"{key}: a list expected")
    return tuple(str(x) for x in v)


# -- supervisor -> run process ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    """The first message to a run process: the run's admitted members besides this node and
    how many other nodes may still join (:data:`UNBOUNDED`: statuses may still arrive)."""

    type: ClassVar[str] = "start"
    members: tuple[str, ...] = ()
    may_join: int = UNBOUNDED

    def to_json(self) -> JSON:
        return {"members": list(self.members), "may_join": self.may_join}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Start:
        return cls(_strs(doc, "members"), _int(doc, "may_join", UNBOUNDED))


@dataclasses.dataclass(frozen=True)
class Ack:
    """The supervisor recorded the :class:`StateReport` numbered ``seq``."""

    type: ClassVar[str] = "ack"
    seq: int

    def to_json(self) -> JSON:
        return {"seq": self.seq}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Ack:
        return cls(_int(doc, "seq"))


@dataclasses.dataclass(frozen=True)
class MayJoin:
    """How many other nodes may still join the run (a node that declined is not waited for)."""

    type: ClassVar[str] = "may_join"
    n: int

    def to_json(self) -> JSON:
        return {"n": self.n}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MayJoin:
        return cls(_int(doc, "n", UNBOUNDED))


@dataclasses.dataclass(frozen=True)
class Reload:
    """SIGHUP: the supervisor checked ``node.toml`` again; the run applies what can change while
    it runs (:func:`~dfl_agent.runtime.run.reload.reload_config`)."""

    type: ClassVar[str] = "reload"

    def to_json(self) -> JSON:
        return {}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Reload:
        return cls()


# -- run process -> supervisor ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Presence:
    """The node's presence descriptor while the run trains (the supervisor signs and
    publishes ``{"state": "online", "descriptor": ...}``)."""

    type: ClassVar[str] = "presence"
    descriptor: JSON

    def to_json(self) -> JSON:
        return {"descriptor": dict(self.descriptor)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Presence:
        return cls(_dict(doc, "descriptor"))


@dataclasses.dataclass(frozen=True)
class Goodbye:
    """The node leaves the run's rounds now (its transport stops): the supervisor publishes its
    presence "offline" at once, so that its peers hear it while they still listen."""

    type: ClassVar[str] = "goodbye"

    def to_json(self) -> JSON:
        return {}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Goodbye:
        return cls()


@dataclasses.dataclass(frozen=True)
class RunCounters:
    """The run's node's byte and drop counters that the service shows: wire bytes sent and
    received, dropped messages by reason, and steps whose non-finite result was restored."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)
    diverged: int = 0

    def to_json(self) -> JSON:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "dropped": dict(self.dropped), "diverged": self.diverged}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RunCounters:
        dropped = doc.get("dropped") or {}
        if not isinstance(dropped, dict):
            raise PipeError("counters.dropped: an object expected")
        return cls(_int(doc, "bytes_sent", 0), _int(doc, "bytes_received", 0),
                   {str(k): int(v) for k, v in dropped.items() if isinstance(v, int) and not isinstance(v, bool)},
                   _int(doc, "diverged", 0))


@dataclasses.dataclass(frozen=True)
class StatusReport:
    """The node's status (:meth:`~dfl_agent.runtime.node.node.Node.status`), its counters, its
    live peers and the round of its last checkpoint (0: none yet)."""

    type: ClassVar[str] = "status"
    status: JSON
    counters: RunCounters | None = None
    live_peers: tuple[str, ...] | None = None
    checkpoint_round: int = 0

    def to_json(self) -> JSON:
        out: JSON = {"status": dict(self.status), "checkpoint_round": self.checkpoint_round}
        if self.counters is not None:
            out["counters"] = self.counters.to_json()
        if self.live_peers is not None:
            out["live_peers"] = list(self.live_peers)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StatusReport:
        counters = RunCounters.from_json(_dict(doc, "counters")) if doc.get("counters") is not None else None
        peers = _strs(doc, "live_peers") if doc.get("live_peers") is not None else None
        return cls(_dict(doc, "status"), counters, peers, _int(doc, "checkpoint_round", 0))


@dataclasses.dataclass(frozen=True)
class StateReport:
    """A state of the run after its rounds (:data:`AFTER_ROUNDS`), numbered ``seq``: the run
    process waits for the supervisor's :class:`Ack` of it.

    Attributes:
        round: the last round trained here.
        snapshot_last_id: the newest sample id of the run's data snapshot (the sample store), or None.
        version: for ``deployed``, the model version the run process installed (not yet current).
        start: for ``trained``, the run's start (warm start: ``init``, ``started_from``, ``reason``).
        degraded: for a run closed alone in some rounds, :func:`~dfl_agent.runtime.shared.degraded.degraded_fields`.
        peak_rss_mb: the run process's peak resident memory so far (MiB), or None (a line
            without it: an earlier release's run process).
        source: for a model another member deployed (``adopted``, or ``kept`` by this node's
            gate): ``{"node", "version", "sha256", "round"}`` of the member's version, else None.
        reason: why the node ended the run so (``kept``: the gate's note; a checkpoint's model
            deployed because no member could provide the run's final one), or None.
    """

    type: ClassVar[str] = "state"
    state: str
    seq: int
    round: int = 0
    snapshot_last_id: int | None = None
    version: int | None = None
    start: JSON | None = None
    degraded: JSON = dataclasses.field(default_factory=dict)
    peak_rss_mb: float | None = None
    source: JSON | None = None
    reason: str | None = None

    def to_json(self) -> JSON:
        out: JSON = {"state": self.state, "seq": self.seq, "round": self.round, **self.degraded}
        for k in ("snapshot_last_id", "version", "start", "peak_rss_mb", "source", "reason"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StateReport:
        state = doc.get("state")
        if state not in AFTER_ROUNDS:
            raise PipeError(f"state: one of {AFTER_ROUNDS} expected, got {state!r}")
        start, source = doc.get("start"), doc.get("source")
        return cls(str(state), _int(doc, "seq"), _int(doc, "round", 0), _opt_int(doc, "snapshot_last_id"),
                   _opt_int(doc, "version"), dict(start) if isinstance(start, dict) else None,
                   {k: doc[k] for k in DEGRADED_KEYS if k in doc}, _opt_mb(doc, "peak_rss_mb"),
                   dict(source) if isinstance(source, dict) else None, _opt_str(doc, "reason"))


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why the run cannot start (``kind`` ``startup``: a bad configuration or data) or why
    it crashed (``crash``: the exception, one line)."""

    type: ClassVar[str] = "error"
    kind: str
    message: str

    def to_json(self) -> JSON:
        return {"kind": self.kind, "message": self.message}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Failure:
        kind = doc.get("kind", "crash")
        if kind not in FAILURES:
            raise PipeError(f"kind: one of {FAILURES} expected, got {kind!r}")
        return cls(str(kind), str(doc.get("message", "")))


@dataclasses.dataclass(frozen=True)
class End:
    """How the run ended in the run process (its last message).

    Attributes:
        outcome: ``finished``, ``stopped`` (a stop, a cancel, or the broker unreachable) or
            ``missed`` (:data:`OUTCOMES`).
        round: the round of the node's last status; last_round: the last round completed.
        data_shape: the data's ``[input shape, number of classes]`` once loaded, or None.
        snapshot_last_id: the newest sample id of the run's data snapshot, or None.
        drops: the run's drops that the service keeps (:func:`~dfl_agent.runtime.shared.pipe.run_drops`).
        peak_rss_mb: the run process's peak resident memory over its life (MiB), or None (a
            line without it: an earlier release's run process).
        reason: for ``missed``, why (each member's answer), else None.
    """

    type: ClassVar[str] = "end"
    outcome: str
    round: int = 0
    last_round: int = 0
    data_shape: list[Any] | None = None
    snapshot_last_id: int | None = None
    drops: Mapping[str, int] = dataclasses.field(default_factory=dict)
    peak_rss_mb: float | None = None
    reason: str | None = None

    def to_json(self) -> JSON:
        out: JSON = {"outcome": self.outcome, "round": self.round, "last_round": self.last_round,
                     "data_shape": self.data_shape, "snapshot_last_id": self.snapshot_last_id,
                     "drops": dict(self.drops)}
        for k in ("peak_rss_mb", "reason"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> End:
        shape = doc.get("data_shape")
        drops = doc.get("drops") or {}
        if not isinstance(drops, dict):
            raise PipeError("drops: an object expected")
        return cls(str(doc.get("outcome", "stopped")), _int(doc, "round", 0), _int(doc, "last_round", 0),
                   list(shape) if isinstance(shape, list) else None, _opt_int(doc, "snapshot_last_id"),
                   {str(k): int(v) for k, v in drops.items() if isinstance(v, int) and not isinstance(v, bool)},
                   _opt_mb(doc, "peak_rss_mb"), _opt_str(doc, "reason"))


ToRun = Start | Ack | MayJoin | Reload
FromRun = Presence | Goodbye | StatusReport | StateReport | Failure | End
Message = ToRun | FromRun

_KINDS: dict[str, type[Message]] = {c.type: c for c in (Start, Ack, MayJoin, Reload, Presence, Goodbye, StatusReport, StateReport, Failure, End)}


def to_line(msg: Message) -> bytes:
    """One message as a JSON line (UTF-8, ``\\n``-terminated)."""
    return (json.dumps({"type": msg.type, **msg.to_json()}, sort_keys=True, default=float) + "\n").encode()


def from_line(line: bytes | str) -> Message:
    """The message of one JSON line.

    Raises:
        PipeError: not JSON, too large or deep, not an object, an unknown ``type``, or a
            field of the wrong type (the text names it).
    """
    try:
        doc = bounded_loads(line if isinstance(line, bytes) else line.encode(), "state", max_bytes=MAX_LINE_BYTES)
    except (JSONBoundError, ValueError) as exc:
        raise PipeError(f"not a pipe message: {exc}") from None
    if not isinstance(doc, dict):
        raise PipeError("not a pipe message: not an object")
    kind = doc.get("type")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise PipeError(f"unknown message type {doc.get('type')!r}")
    try:
        return cls.from_json(doc)
    except (TypeError, ValueError) as exc:
        raise PipeError(f"{doc.get('type')}: {exc}") from None
