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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.runtime.shared.degraded import FIELDS as DEGRADED_FIELDS

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

JSON = dict[str, Any]
#: a run node's drop counters that the service keeps (the lobby counts the statuses itself)
RUN_KEEPS = ("presence_", "bad_presence", "model_files_")


def run_drops(dropped: Mapping[str, int] | None) -> dict[str, int]:
    """The drops of a run's node (``dropped``: reason -> count) that the service keeps
    (:data:`RUN_KEEPS`), ``{}`` for None."""
    return {k: int(v) for k, v in dict(dropped or {}).items() if k.startswith(RUN_KEEPS)}


class PipeError(ValueError):
    """A line that is not a message of the pipe (its text names why)."""


#: ``read(value, key) -> field``: one field of a message from its value in the line's JSON
#: object (the field's default where the line has no ``key``; None for a required field);
#: raises PipeError, naming ``key``, for a wrong value
Read = Callable[[Any, str], Any]


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise PipeError(f"{key}: an integer expected, got {v!r}")
    return v


def _mb(v: Any, key: str) -> float:
    """A size in MiB: a non-negative finite number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise PipeError(f"{key}: a size in MiB expected, got {v!r}")
    return float(v)


def _str(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise PipeError(f"{key}: a string expected, got {type(v).__name__}")
    return v


def _dict(v: Any, key: str) -> JSON:
    if not isinstance(v, dict):
        raise PipeError(f"{key}: an object expected")
    return dict(v)


def _strs(v: Any, key: str) -> tuple[str, ...]:
    if not isinstance(v or [], list):
        raise PipeError(f"{key}: a list expected")
    return tuple(str(x) for x in v or [])


def _text(v: Any, key: str) -> str:
    return str(v)


def _optional(read: Read) -> Read:
    """``read``, or None where the line has no value (absent or null)."""
    return lambda v, key: None if v is None else read(v, key)


def _lenient(kind: type) -> Read:
    """A ``kind`` (an object, a list) as the line has it, or None for anything else."""
    return lambda v, key: kind(v) if isinstance(v, kind) else None


def _one_of(choices: tuple[str, ...]) -> Read:
    """A text that must be one of ``choices``."""
    def read(v: Any, key: str) -> str:
        if v not in choices:
            raise PipeError(f"{key}: one of {choices} expected, got {v!r}")
        return str(v)
    return read


def _counts(label: str) -> Read:
    """Counters by name (an object; ``label`` names it in an error): entries that are not
    integers are left out."""
    def read(v: Any, key: str) -> dict[str, int]:
        if not isinstance(v or {}, dict):
            raise PipeError(f"{label}: an object expected")
        return {str(k): int(n) for k, n in (v or {}).items() if isinstance(n, int) and not isinstance(n, bool)}
    return read


def _field(read: Read, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
           null: bool = False, spread: bool = False) -> Any:
    """A message field that ``read`` reads from a line.  A None value is left out of the line
    unless ``null``; a ``spread`` field's entries stand at the line's top level (its ``read``
    gets the whole object)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"read": read, "null": null, "spread": spread})


class _Codec:
    """A message's JSON object (``to_json``) and the message of one (``from_json``), field by
    field as its dataclass declares them (:func:`_field`)."""

    def to_json(self) -> JSON:
        out: JSON = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.metadata["spread"]:
                out.update(v)
            elif v is not None or f.metadata["null"]:
                out[f.name] = v.to_json() if isinstance(v, _Codec) else list(v) if isinstance(v, tuple) \
                    else dict(v) if isinstance(v, Mapping) else v
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Any:
        """Raises PipeError for a wrong field (the first, in the order the class declares them)."""
        return cls(**{f.name: f.metadata["read"](doc if f.metadata["spread"] else doc.get(
            f.name, None if f.default is dataclasses.MISSING else f.default), f.name)
            for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def _degraded(doc: Mapping[str, Any], key: str) -> JSON:
    return {k: doc[k] for k in DEGRADED_FIELDS if k in doc}  # the degraded-run fields a state report may carry


# -- supervisor -> run process ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start(_Codec):
    """The first message to a run process: the run's admitted members besides this node and
    how many other nodes may still join (:data:`UNBOUNDED`: statuses may still arrive)."""

    type: ClassVar[str] = "start"
    members: tuple[str, ...] = _field(_strs, ())
    may_join: int = _field(_int, UNBOUNDED)


@dataclasses.dataclass(frozen=True)
class Ack(_Codec):
    """The supervisor recorded the :class:`StateReport` numbered ``seq``."""

    type: ClassVar[str] = "ack"
    seq: int = _field(_int)


@dataclasses.dataclass(frozen=True)
class MayJoin(_Codec):
    """How many other nodes may still join the run (a node that declined is not waited for)."""

    type: ClassVar[str] = "may_join"
    n: int = _field(_int, UNBOUNDED)


@dataclasses.dataclass(frozen=True)
class Reload(_Codec):
    """SIGHUP: the supervisor checked ``node.toml`` again; the run applies what can change while
    it runs (:func:`~dfl_agent.runtime.run.reload.reload_config`)."""

    type: ClassVar[str] = "reload"


# -- run process -> supervisor ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Presence(_Codec):
    """The node's presence descriptor while the run trains (the supervisor signs and
    publishes ``{"state": "online", "descriptor": ...}``)."""

    type: ClassVar[str] = "presence"
    descriptor: JSON = _field(_dict)


@dataclasses.dataclass(frozen=True)
class Goodbye(_Codec):
    """The node leaves the run's rounds now (its transport stops): the supervisor publishes its
    presence "offline" at once, so that its peers hear it while they still listen."""

    type: ClassVar[str] = "goodbye"


@dataclasses.dataclass(frozen=True)
class RunCounters(_Codec):
    """The run's node's byte and drop counters that the service shows: wire bytes sent and
    received, dropped messages by reason, and steps whose non-finite result was restored."""

    bytes_sent: int = _field(_int, 0)
    bytes_received: int = _field(_int, 0)
    dropped: Mapping[str, int] = _field(_counts("counters.dropped"), factory=dict)
    diverged: int = _field(_int, 0)


@dataclasses.dataclass(frozen=True)
class StatusReport(_Codec):
    """The node's status (:meth:`~dfl_agent.runtime.node.node.Node.status`), its counters, its
    live peers and the round of its last checkpoint (0: none yet)."""

    type: ClassVar[str] = "status"
    status: JSON = _field(_dict)
    counters: RunCounters | None = _field(_optional(lambda v, key: RunCounters.from_json(_dict(v, key))), None)
    live_peers: tuple[str, ...] | None = _field(_optional(_strs), None)
    checkpoint_round: int = _field(_int, 0)


@dataclasses.dataclass(frozen=True)
class StateReport(_Codec):
    """A state of the run after its rounds (:data:`AFTER_ROUNDS`), numbered ``seq``: the run
    process waits for the supervisor's :class:`Ack` of it.

    Attributes:
        round: the last round trained here.
        snapshot_last_id: the newest sample id of the run's data snapshot (the sample store), or None.
        version: for ``deployed``, the model version the run process installed (not yet current).
        start: for ``trained``, the run's start (warm start: ``init``, ``started_from``, ``reason``).
        degraded: for a run closed alone in some rounds, :func:`~dfl_agent.runtime.shared.degraded.degraded_fields`
            (its entries stand at the line's top level).
        peak_rss_mb: the run process's peak resident memory so far (MiB), or None (a line
            without it: an earlier release's run process).
        source: for a model another member deployed (``adopted``, or ``kept`` by this node's
            gate): ``{"node", "version", "sha256", "round"}`` of the member's version, else None.
        reason: why the node ended the run so (``kept``: the gate's note; a checkpoint's model
            deployed because no member could provide the run's final one), or None.
    """

    type: ClassVar[str] = "state"
    state: str = _field(_one_of(AFTER_ROUNDS))
    seq: int = _field(_int)
    round: int = _field(_int, 0)
    snapshot_last_id: int | None = _field(_optional(_int), None)
    version: int | None = _field(_optional(_int), None)
    start: JSON | None = _field(_lenient(dict), None)
    degraded: JSON = _field(_degraded, factory=dict, spread=True)
    peak_rss_mb: float | None = _field(_optional(_mb), None)
    source: JSON | None = _field(_lenient(dict), None)
    reason: str | None = _field(_optional(_str), None)


@dataclasses.dataclass(frozen=True)
class Failure(_Codec):
    """Why the run cannot start (``kind`` ``startup``: a bad configuration or data) or why
    it crashed (``crash``: the exception, one line)."""

    type: ClassVar[str] = "error"
    kind: str = _field(_one_of(FAILURES), "crash")
    message: str = _field(_text, "")


@dataclasses.dataclass(frozen=True)
class End(_Codec):
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
    outcome: str = _field(_text, "stopped")
    round: int = _field(_int, 0)
    last_round: int = _field(_int, 0)
    data_shape: list[Any] | None = _field(_lenient(list), None, null=True)
    snapshot_last_id: int | None = _field(_optional(_int), None, null=True)
    drops: Mapping[str, int] = _field(_counts("drops"), factory=dict)
    peak_rss_mb: float | None = _field(_optional(_mb), None)
    reason: str | None = _field(_optional(_str), None)


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
