"""Run descriptors: what a run is, its ids, and how its signed message is made and checked.

A run is a training campaign an operator submits to a whole federation.  It is described
by a :class:`RunDescriptor`, published retained and signed on ``dfl/{fed}/run/{run_id}``
(see :func:`sign_descriptor`), so a device that boots late still finds it.

A node's configured ``[algorithm]`` section is its *default run*: its id is a hash of
the federation and the canonical run settings (:func:`default_run_id`) and is never
published; with ``algorithm.every`` it recurs once per period, each repeat's id being
the default id plus the period index (:func:`recurring_run_id`).

Who may submit: with ``security.require_signatures`` only an *operator* - a key named
in ``security.operators`` or holding a certificate with ``role = "operator"`` signed by
the federation key - may submit or cancel; anything else is refused (see
:meth:`RunVerifier.check`), logged and counted.

Cancel stays cancelled: ``dflctl run cancel`` also publishes a retained, operator-signed
*cancel record* on ``dfl/{fed}/run/{run_id}/cancel`` (:func:`sign_cancel`,
:meth:`RunVerifier.check_cancel`).  A node reads the cancel records before the
descriptors and remembers cancelled ids in its ledger, so a replayed copy of a cancelled
run's submission is refused (``cancelled``), also by a node enrolled after the cancel.
A descriptor's signed ``not_after`` (unix s; ``dflctl run submit`` sets it 24 h after
submission) is the last moment a node that has not started the run may start it
(refused as ``expired`` afterwards).

Admission against the device profile is :mod:`dfl_agent.runtime.service.admission`; the node's
run history :mod:`dfl_agent.runtime.service.ledger`; the listener :mod:`dfl_agent.runtime.service.lobby`;
the run's life on this node :mod:`dfl_agent.runtime.service.run_manager`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from dfl_agent.jsonbound import JSONBoundError
from dfl_agent.jsonbound import loads as bounded_loads
from dfl_agent.security.keys import DEFAULT_VALID_DAYS, issue_certificate
from dfl_agent.security.trust import ControlRejected, SecurityGuard, SeqCounter, TrustStore

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SCHEMA_VERSION = 1
#: terminal states: a run in one of these is never (re)started on this node
TERMINAL = ("finished", "failed", "cancelled", "declined", "missed")
#: reasons a run descriptor message is refused (counters ``run_refused_<reason>``)
REFUSE_REASONS = ("malformed", "oversized", "too_deep", "unsigned", "unknown_key", "not_operator", "bad_signature",
                  "wrong_federation", "replay", "cancelled", "expired", "revoked", "certificate_expired",
                  "certificate_not_yet_valid")
#: a cancel record that may not be used is counted as ``cancel_<reason>`` (reasons as above)
CANCEL_PREFIX = "cancel_"
SIG_PREFIX = "ed25519:"
#: a run's ``init``: start from the deployed model (warm start) or from fresh weights
INIT_MODES = ("deployed", "fresh")
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def run_topic(federation: str, run_id: str = "+") -> str:
    """The retained topic of a run descriptor: ``dfl/{fed}/run/{run_id}``."""
    return f"dfl/{federation}/run/{run_id}"


def cancel_topic(federation: str, run_id: str = "+") -> str:
    """The retained topic of a run's cancel record: ``dfl/{fed}/run/{run_id}/cancel``."""
    return f"dfl/{federation}/run/{run_id}/cancel"


@dataclasses.dataclass
class RunDescriptor:
    """What a run is: published (signed) on ``dfl/{fed}/run/{run_id}``.

    Attributes:
        run_id: unique id (``[A-Za-z0-9_.-]{1,64}``).
        federation: the federation it is for.
        algorithm: algorithm name; ``options`` its options.
        rounds: rounds to run (>= 1).
        name: a human label.
        model: ``{"spec": {...}}``, ``{"family": str}`` or ``{"size": "small|medium|large"}``
            (empty: the profile's tier).  Overrides the node's ``[model]``.
        training: overrides of ``[training]`` keys (epochs, steps, lr, ...).
        compression: overrides of ``[compression]`` keys.
        members: ``"all"``, a list of node ids, or ``{"profile": [names]}``.
        min_members: devices that must accept before it starts.
        start_at: unix time before which it does not start (``None``: at once).
        start_timeout: seconds to wait for ``min_members`` before it fails.
        submitter: operator name; ``submitted_at``: unix time (signed) - the queue order.
        cancelled: set by ``dflctl run cancel`` (a newer signed copy of the descriptor).
        not_after: unix time after which a node that has not started the run refuses it
            (``None``: never; signed like every field).
        seq: increases with every publication of the same run (replay protection).
        init: where each member's model starts: ``"deployed"`` (its deployed model when the
            architecture matches, see :mod:`dfl_agent.runtime.run.warm_start`) or ``"fresh"``;
            ``None`` (descriptors from before the field too): the node's ``runtime.run_init``.
    """

    run_id: str
    federation: str
    algorithm: str
    rounds: int
    name: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    compression: dict[str, Any] = dataclasses.field(default_factory=dict)
    members: Literal["all"] | list[str] | dict[str, list[str]] = "all"  # "all", node ids, or {"profile": [names]}
    min_members: int = 1
    start_at: float | None = None
    start_timeout: float = 600.0
    submitter: str = ""
    submitted_at: float = 0.0
    cancelled: bool = False
    seq: int = 0
    not_after: float | None = None
    init: str | None = None
    default: bool = False  # a node's own default run (never published)

    def to_dict(self) -> dict[str, Any]:
        """The descriptor as a JSON-ready dict (``schema_version`` included)."""
        d = dataclasses.asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, raw: object) -> RunDescriptor:
        """Parse and validate a descriptor dict.

        Raises:
            ValueError: missing or ill-typed fields, bad ids, rounds < 1.
        """
        if not isinstance(raw, Mapping):
            raise ValueError("run descriptor is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in raw.items() if k in names}
        for k in ("run_id", "federation", "algorithm", "rounds"):
            if k not in kw:
                raise ValueError(f"run descriptor lacks {k!r}")
        d = cls(**kw)
        if not (isinstance(d.run_id, str) and _ID_RE.match(d.run_id)):
            raise ValueError(f"bad run_id {d.run_id!r}")
        if not (isinstance(d.federation, str) and _ID_RE.match(d.federation)):
            raise ValueError(f"bad federation {d.federation!r}")
        if not isinstance(d.algorithm, str) or not d.algorithm:
            raise ValueError("bad algorithm")
        if not isinstance(d.rounds, int) or isinstance(d.rounds, bool) or d.rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {d.rounds!r}")
        if not isinstance(d.min_members, int) or d.min_members < 1:
            raise ValueError("min_members must be an integer >= 1")
        for k in ("options", "model", "training", "compression"):
            if not isinstance(getattr(d, k), dict):
                raise ValueError(f"{k} must be an object")
        if not isinstance(d.submitted_at, (int, float)) or not isinstance(d.seq, int):
            raise ValueError("submitted_at / seq have wrong types")
        if d.not_after is not None and (not isinstance(d.not_after, (int, float)) or isinstance(d.not_after, bool)):
            raise ValueError("not_after must be a unix time or null")
        if d.init not in (None, *INIT_MODES):
            raise ValueError(f"init must be 'deployed' or 'fresh' (or absent: the node's runtime.run_init), "
                             f"got {d.init!r}")
        if not (d.members == "all" or (isinstance(d.members, list) and all(isinstance(m, str) for m in d.members))
                or (isinstance(d.members, dict) and isinstance(d.members.get("profile"), list))):
            raise ValueError("members must be 'all', a list of node ids or {'profile': [names]}")
        return d

    def order_key(self) -> tuple[float, str]:
        """Queue order: signed ``submitted_at``, then ``run_id``."""
        return (float(self.submitted_at), self.run_id)

    def expired(self, now: float) -> bool:
        """Whether ``not_after`` has passed at ``now`` (unix s): a node that has not
        started the run refuses it then."""
        return self.not_after is not None and now > float(self.not_after)

    def is_for(self, node_id: str, profile: str) -> bool:
        """Whether this node is among the run's members."""
        if self.members == "all":
            return True
        if isinstance(self.members, list):
            return node_id in self.members
        return profile in self.members.get("profile", [])


def new_run_id(federation: str, algorithm: str, submitted_at: float, nonce: str) -> str:
    """A fresh run id for a submission: ``r-`` + 12 hex of a hash."""
    h = hashlib.sha256(f"{federation}|{algorithm}|{submitted_at!r}|{nonce}".encode()).hexdigest()
    return "r-" + h[:12]


def default_run_id(federation: str, settings: Mapping[str, Any]) -> str:
    """The default run's id: ``d-`` + 12 hex of a hash of the federation and the
    canonical run settings (algorithm, options, rounds, model, training, compression).
    Never published."""
    canonical = json.dumps(dict(settings), sort_keys=True, separators=(",", ":"), allow_nan=False)
    h = hashlib.sha256(federation.encode() + b"|" + canonical.encode()).hexdigest()
    return "d-" + h[:12]


def recurring_run_id(default_id: str, period_index: int) -> str:
    """The id of the ``period_index``-th repeat of a recurring default run."""
    return f"{default_id}.{int(period_index)}"


def period_index(now: float, every_s: float, epoch: float = 0.0) -> int:
    """Which period ``now`` falls in, for a run recurring every ``every_s`` seconds
    (periods counted from ``epoch``, unix s)."""
    return int((now - epoch) // every_s)


def sample_run_id(default_id: str, index: int) -> str:
    """The id of the ``index``-th run of a default run recurring on new samples."""
    return f"{default_id}.s{int(index)}"


# -- signing ---------------------------------------------------------------------
def operator_certificate(federation_key: Ed25519PrivateKey, federation: str, name: str, public_b64: str,
                         valid_days: float | None = DEFAULT_VALID_DAYS) -> dict[str, Any]:
    """An operator certificate (version 2, ``role = "operator"``) signed by the federation key
    (what ``dflctl keys enroll NAME --role operator`` writes), valid ``valid_days`` days (None: never expires)."""
    return issue_certificate(federation_key, federation, name, public_b64, valid_days=valid_days, role="operator")


def run_kind(run_id: str) -> str:
    """The control-envelope ``kind`` of run ``run_id``'s descriptor: ``"run:{run_id}"``.

    Sequence numbers are per (sender, kind) (:class:`~dfl_agent.security.trust.SecurityGuard`),
    so each run has its own: the retained descriptors of several runs may reach a device in
    any order, and only a newer copy of the *same* run (a cancel) must carry a higher one."""
    return f"run:{run_id}"


def sign_descriptor(d: RunDescriptor, key: Ed25519PrivateKey | None, signer: str = "", cert: dict[str, Any] | None = None,
                    seq: SeqCounter | None = None) -> bytes:
    """The retained message for ``d``: a signed control envelope of kind :func:`run_kind`
    (:meth:`~dfl_agent.security.trust.SecurityGuard.sign_control`, the same envelope as
    presence and status) whose payload is the descriptor, sent by ``signer`` with its
    ``cert``; unsigned (``sig`` null) when ``key`` is None.

    Args:
        seq: a :class:`~dfl_agent.security.trust.SeqCounter` (persist it, e.g. in the
            operator's folder); None counts from the clock in milliseconds, which also
            grows from one ``dflctl`` call to the next.
    """
    guard = SecurityGuard(signer or "anonymous", key, TrustStore(d.federation), certificate=cert,
                          seq=seq if seq is not None else SeqCounter(None))
    return guard.sign_control(run_kind(d.run_id), d.to_dict(), d.federation)


def cancel_kind(run_id: str) -> str:
    """The control-envelope ``kind`` of run ``run_id``'s cancel record: ``"cancel:{run_id}"``."""
    return f"cancel:{run_id}"


def sign_cancel(federation: str, run_id: str, key: Ed25519PrivateKey | None, signer: str = "",
                cert: dict[str, Any] | None = None, seq: SeqCounter | None = None, at: float | None = None) -> bytes:
    """The retained cancel record of run ``run_id`` (for :func:`cancel_topic`): a signed
    control envelope of kind :func:`cancel_kind` whose payload is ``{"run_id",
    "federation", "cancelled_at"}``; unsigned when ``key`` is None.  ``seq`` as in
    :func:`sign_descriptor`."""
    import time

    guard = SecurityGuard(signer or "anonymous", key, TrustStore(federation), certificate=cert,
                          seq=seq if seq is not None else SeqCounter(None))
    body = {"run_id": run_id, "federation": federation, "cancelled_at": time.time() if at is None else at}
    return guard.sign_control(cancel_kind(run_id), body, federation)


def open_run_message(payload: bytes | str | Mapping[str, Any]) -> dict[str, Any] | None:
    """An unverified view of a run message for display (``dflctl run list/show``):
    ``{"descriptor": dict, "signer": str, "sig": str | None, "seq": int}``, or None when it
    is not a run message (also when over 64 KiB or nested deeper than 32 levels).
    Verification is :meth:`RunVerifier.check`'s job."""
    try:
        msg = bounded_loads(payload, "descriptor") if isinstance(payload, (bytes, str)) else dict(payload)
    except (ValueError, UnicodeDecodeError, TypeError):
        return None
    if not isinstance(msg, dict):
        return None
    if "ctl" in msg:  # the control envelope
        body, kind = msg.get("payload"), msg.get("kind")
        if not (isinstance(body, dict) and isinstance(kind, str) and kind.startswith("run:")):
            return None
        return {"descriptor": body, "signer": msg.get("sender"), "sig": msg.get("sig"), "seq": msg.get("seq")}
    if isinstance(msg.get("descriptor"), dict):  # already opened
        return msg
    return None


#: control-envelope rejection reasons -> run refusal reasons (:data:`REFUSE_REASONS`)
_REFUSAL = {"unknown_sender": "unknown_key", "wrong_kind": "malformed", "wrong_sender": "malformed",
            # the signer's certificate (``expired`` alone means a run past its ``not_after``)
            "expired": "certificate_expired", "not_yet_valid": "certificate_not_yet_valid"}


class RunVerifier:
    """Decides whether a run descriptor message may be used: the control envelope is
    checked by a :class:`~dfl_agent.security.trust.SecurityGuard` (signature, the
    sender's key pinned or certified by the federation key, per-(sender, run) sequence
    number), then the operator rule.

    Args:
        federation: this node's federation.
        require_signatures: refuse unsigned or non-operator descriptors.
        federation_key: base64 federation public key (verifies operator certificates).
        operators: ``{name: base64 public key}`` of pinned operator keys.
        guard: the node's own SecurityGuard (its trust store: pinned keys, operators,
            federation key); None builds one from the arguments above.
    """

    def __init__(self, federation: str, *, require_signatures: bool, federation_key: str | None = None,
                 operators: Mapping[str, str] | None = None, guard: SecurityGuard | None = None):
        self.federation = federation
        self.require_signatures = require_signatures
        if guard is None:
            guard = SecurityGuard("", None, TrustStore(federation, operators=dict(operators or {}),
                                                       federation_key=federation_key),
                                  require_signatures=require_signatures)
        self.guard = guard
        self.refused: dict[str, int] = {}

    def check(self, payload: bytes | bytearray) -> tuple[RunDescriptor | None, str | None]:
        """``(descriptor, None)`` when usable, else ``(None, reason)`` with the reason one
        of :data:`REFUSE_REASONS` (counted in :attr:`refused`), or ``"duplicate"`` for the
        very message accepted last, delivered again (not counted)."""
        d, why = self._check(payload)
        if why is not None and why != "duplicate":
            self.refused[why] = self.refused.get(why, 0) + 1
        return d, why

    def _check(self, payload: bytes | bytearray) -> tuple[RunDescriptor | None, str | None]:
        try:  # bounded first: 64 KiB, nesting depth 32
            env = bounded_loads(payload, "descriptor")
            kind = env.get("kind") if isinstance(env, dict) else None
            if not (isinstance(kind, str) and kind.startswith("run:")):
                raise ValueError("not a run envelope")
        except JSONBoundError as exc:
            return None, exc.reason
        except (ValueError, TypeError, UnicodeDecodeError):
            return None, "malformed"
        try:
            sender, role, body = self.guard.verify_control(payload, kind)
        except ControlRejected as exc:
            return None, _REFUSAL.get(exc.reason, exc.reason if exc.reason in REFUSE_REASONS + ("duplicate",)
                                      else "malformed")
        try:
            d = RunDescriptor.from_dict(body)
        except (ValueError, TypeError):
            return None, "malformed"
        if d.federation != self.federation:
            return None, "wrong_federation"
        if run_kind(d.run_id) != kind:
            return None, "malformed"
        if self.require_signatures:
            if role != "operator":
                return None, "not_operator"
            d.submitter = sender  # the verified operator, whatever the descriptor says
        return d, None

    def check_cancel(self, payload: bytes | bytearray, run_id: str) -> str | None:
        """None when ``payload`` is a usable cancel record of run ``run_id`` (from
        :func:`cancel_topic`): the control envelope of kind :func:`cancel_kind` verified as
        a descriptor is (with ``require_signatures`` an operator's signature), for this
        federation and this run.  Else the reason (one of :data:`REFUSE_REASONS`), counted
        in :attr:`refused` as ``cancel_<reason>``; ``"duplicate"`` (the same record again)
        is not counted."""
        why = self._check_cancel(payload, run_id)
        if why is not None and why != "duplicate":
            key = CANCEL_PREFIX + why
            self.refused[key] = self.refused.get(key, 0) + 1
        return why

    def _check_cancel(self, payload: bytes | bytearray, run_id: str) -> str | None:
        try:
            sender, role, body = self.guard.verify_control(payload, cancel_kind(run_id))
        except ControlRejected as exc:
            return _REFUSAL.get(exc.reason, exc.reason if exc.reason in REFUSE_REASONS + ("duplicate",)
                                else "malformed")
        if body.get("run_id") != run_id:
            return "malformed"
        if body.get("federation") != self.federation:
            return "wrong_federation"
        if self.require_signatures and role != "operator":
            return "not_operator"
        return None

