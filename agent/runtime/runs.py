"""Runs: training campaigns that an operator submits to a whole federation.

An always-on agent (``dfl-agent run``) stays a member of its federation and trains
in *runs*.  A run is described by a :class:`RunDescriptor`, published retained and
signed on ``dfl/{fed}/run/{run_id}`` (see :func:`sign_descriptor`), so a device that
boots late still finds it.  Each device checks a run against its profile
(:func:`admit`), accepts or declines it (the reason shows in its status), and trains in
at most one run at a time; runs queue by the descriptor's signed ``submitted_at``, then
``run_id`` (:class:`RunQueue`), never by broker arrival.

A node's configured ``[algorithm]`` section is its *default run*: its id is a hash of
the federation and the canonical run settings (:func:`default_run_id`) and is never
published; with ``algorithm.every`` it recurs once per period, each repeat's id being
the default id plus the period index (:func:`recurring_run_id`).

Which runs finished (or were cancelled / failed) is kept in
``{state_dir}/runs/ledger.json`` (:class:`RunLedger`, atomic writes), so a finished run
is never rerun, after a reboot too.  Checkpoints and metrics are per run, under
``{state_dir}/runs/{run_id}/``.

Who may submit: with ``security.require_signatures`` only an *operator* - a key named
in ``security.operators`` or holding a certificate with ``role = "operator"`` signed by
the federation key - may submit or cancel; anything else is refused (see
:meth:`RunVerifier.check`), logged and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dfl_agent.jsonbound import JSONBoundError, RateLimitedLog
from dfl_agent.jsonbound import loads as bounded_loads

log = logging.getLogger("dfl_agent.runs")

SCHEMA_VERSION = 1
#: node-side run states shown in status (``run.state``) and ``dflctl run show``
NODE_STATES = ("queued", "accepted", "declined", "training", "finished", "failed", "cancelled")
#: terminal states: a run in one of these is never (re)started on this node
TERMINAL = ("finished", "failed", "cancelled", "declined")
#: reasons a run descriptor message is refused (counters ``run_refused_<reason>``)
REFUSE_REASONS = ("malformed", "oversized", "too_deep", "unsigned", "unknown_key", "not_operator", "bad_signature",
                  "wrong_federation", "replay")
SIG_PREFIX = "ed25519:"
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def run_topic(federation: str, run_id: str = "+") -> str:
    """The retained topic of a run descriptor: ``dfl/{fed}/run/{run_id}``."""
    return f"dfl/{federation}/run/{run_id}"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_duration(text: str | float | int) -> float:
    """Seconds in a duration such as ``"6h"``, ``"90s"``, ``"15m"``, ``"2d"`` or a number of seconds.

    Raises:
        ValueError: not a positive duration.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
        if not m:
            raise ValueError(f"not a duration: {text!r} (use e.g. '90s', '15m', '6h', '2d')")
        value = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if not value > 0:
        raise ValueError(f"duration must be > 0: {text!r}")
    return value


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
        seq: increases with every publication of the same run (replay protection).
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
    members: Any = "all"
    min_members: int = 1
    start_at: float | None = None
    start_timeout: float = 600.0
    submitter: str = ""
    submitted_at: float = 0.0
    cancelled: bool = False
    seq: int = 0
    default: bool = False  # a node's own default run (never published)

    def to_dict(self) -> dict[str, Any]:
        """The descriptor as a JSON-ready dict (``schema_version`` included)."""
        d = dataclasses.asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, raw: Any) -> RunDescriptor:
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
        if not (d.members == "all" or (isinstance(d.members, list) and all(isinstance(m, str) for m in d.members))
                or (isinstance(d.members, dict) and isinstance(d.members.get("profile"), list))):
            raise ValueError("members must be 'all', a list of node ids or {'profile': [names]}")
        return d

    def order_key(self) -> tuple[float, str]:
        """Queue order: signed ``submitted_at``, then ``run_id``."""
        return (float(self.submitted_at), self.run_id)

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
    h = hashlib.sha256(federation.encode() + b"|" + _canonical(dict(settings))).hexdigest()
    return "d-" + h[:12]


def recurring_run_id(default_id: str, period_index: int) -> str:
    """The id of the ``period_index``-th repeat of a recurring default run."""
    return f"{default_id}.{int(period_index)}"


def period_index(now: float, every_s: float, epoch: float = 0.0) -> int:
    """Which period ``now`` falls in, for a run recurring every ``every_s`` seconds
    (periods counted from ``epoch``, unix s)."""
    return int((now - epoch) // every_s)


def next_recurring(ledger: RunLedger, default_id: str, every_s: float, now: float,
                   running: str | None = None) -> str | None:
    """The repeat of a recurring default run that is due at ``now``, or None.

    A recurring run never overlaps itself: while one of its repeats is ``running``
    nothing is due, and a period whose repeat already ran (or any later one) is not
    due again.  Missed periods are not made up: only the current period's repeat runs.
    """
    if running is not None and running.startswith(default_id + "."):
        return None
    rid = recurring_run_id(default_id, period_index(now, every_s))
    return None if ledger.is_done(rid) else rid


def sample_run_id(default_id: str, index: int) -> str:
    """The id of the ``index``-th run of a default run recurring on new samples."""
    return f"{default_id}.s{int(index)}"


def next_sample_triggered(ledger: RunLedger, default_id: str, every_samples: int,
                          new_samples: Callable[[int], int], running: str | None = None) -> str | None:
    """The repeat of a default run recurring "when at least ``every_samples`` new samples
    arrived" (``algorithm.every_samples``) that is due now, or None.

    The first repeat (``.s0``) runs at once; repeat ``.s{n}`` is unfinished (a restart
    resumes it) or, when done, the next one is due once ``new_samples(last_id)`` - the
    samples the store got after the newest sample id of any repeat's snapshot
    (``snapshot_last_id`` in the ledger; 0 when none was recorded) - reaches
    ``every_samples``.  Never overlaps itself: nothing is due while a repeat is ``running``.
    """
    prefix = default_id + ".s"
    if running is not None and running.startswith(prefix):
        return None
    index = {int(k[len(prefix):]): e for k, e in ledger.entries.items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    if not index:
        return sample_run_id(default_id, 0)
    last = max(index)
    if not ledger.is_done(sample_run_id(default_id, last)):
        return sample_run_id(default_id, last)
    last_id = max((int(e.get("snapshot_last_id") or 0) for e in index.values()), default=0)
    return sample_run_id(default_id, last + 1) if new_samples(last_id) >= every_samples else None


class RunLedger:
    """This node's run history, persisted in ``{state_dir}/runs/ledger.json``.

    Maps run id -> ``{"state", "round", "reason", "time"}``.  Written atomically after
    every change, so a crash never leaves it half-written.
    """

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir) / "runs"
        self.path = self.dir / "ledger.json"
        self.entries: dict[str, dict[str, Any]] = {}
        try:
            raw = bounded_loads(self.path.read_bytes(), "state")
            if isinstance(raw, dict):
                self.entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass

    def run_dir(self, run_id: str) -> Path:
        """Per-run folder (checkpoints, metrics): ``{state_dir}/runs/{run_id}``."""
        return self.dir / run_id

    def set(self, run_id: str, state: str, round: int = 0, reason: str = "",
            extra: Mapping[str, Any] | None = None) -> None:
        """Record ``run_id``'s state on this node (atomic write); ``extra`` fields are kept
        with it (e.g. ``snapshot_last_id``: the newest sample id of the run's data snapshot)."""
        self.entries[run_id] = {"state": state, "round": int(round), "reason": reason, "time": time.time(),
                                **dict(extra or {})}
        self.dir.mkdir(parents=True, exist_ok=True)
        from dfl_agent.fsutil import atomic_write

        atomic_write(self.path, json.dumps(self.entries, sort_keys=True))

    def state(self, run_id: str) -> str | None:
        e = self.entries.get(run_id)
        return e.get("state") if e else None

    def is_done(self, run_id: str) -> bool:
        """True when the run reached a terminal state here (never rerun)."""
        return self.state(run_id) in TERMINAL


class RunQueue:
    """Known runs of a federation (latest accepted copy of each), in queue order."""

    def __init__(self) -> None:
        self.runs: dict[str, RunDescriptor] = {}

    def offer(self, d: RunDescriptor) -> bool:
        """Add or update a run; a copy with a lower ``seq`` than the known one is ignored
        (returns False)."""
        old = self.runs.get(d.run_id)
        if old is not None and d.seq <= old.seq:
            return False
        self.runs[d.run_id] = d
        return True

    def ordered(self) -> list[RunDescriptor]:
        """All runs by ``submitted_at`` then ``run_id``."""
        return sorted(self.runs.values(), key=RunDescriptor.order_key)

    def next_runnable(self, done: Callable[[str], bool], now: float | None = None) -> RunDescriptor | None:
        """The first run in queue order that is not cancelled, not done here, and whose
        ``start_at`` has passed."""
        now = time.time() if now is None else now
        for d in self.ordered():
            if d.cancelled or done(d.run_id):
                continue
            if d.start_at is not None and d.start_at > now:
                continue
            return d
        return None


# -- profile admission ----------------------------------------------------------
def spec_params(spec: Mapping[str, Any]) -> int:
    """Φ, the trainable parameters of the model ``spec`` describes, counted without
    allocating them (the model is built on PyTorch's ``meta`` device, so a huge spec
    costs no memory).

    Raises:
        ValueError: an invalid spec.
    """
    import torch

    from dfl_agent.models import build_model, count_trainable, validate_spec

    with torch.device("meta"):
        return int(count_trainable(build_model(validate_spec(dict(spec)))))


def run_model_params(d: RunDescriptor, profile: Any, *, input_shape: Any = None, num_classes: int | None = None,
                     node_model: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """Φ of the model this device would train in run ``d``, and where the figure comes from.

    The descriptor's model wins over the node's ``[model]`` (``node_model``): a ``spec`` is
    counted as it is; a ``family`` member or a ``size`` tier (else the algorithm's default
    model for the profile's tier) is built for the data's ``input_shape`` and
    ``num_classes`` when they are known (after a first run), else Φ is the reference
    model of the tier (:data:`dfl_agent.profiles.behaviour.REFERENCE_MODEL_PARAMS`).

    Raises:
        ValueError: an invalid spec or family.
    """
    from dfl_agent.profiles.behaviour import REFERENCE_MODEL_PARAMS, model_tier

    model = dict(d.model) if d.model else {k: v for k, v in (node_model or {}).items() if v is not None}
    if model.get("spec"):
        return spec_params(model["spec"]), "the run's model spec" if d.model else "model.spec"
    try:
        tier = str(model.get("size") or (profile.model.size if model.get("family") else model_tier(profile, d.algorithm)))
    except KeyError:
        tier = "medium"
    if input_shape is None or num_classes is None:
        return REFERENCE_MODEL_PARAMS.get(tier, REFERENCE_MODEL_PARAMS["medium"]), f"reference {tier} model"
    if model.get("family"):
        from dfl_agent.models.families import family_member

        return spec_params(family_member(str(model["family"]), input_shape, num_classes, tier)), \
            f"{model['family']} member for {tier}"
    from dfl_agent.models.defaults import algorithm_default_spec

    return spec_params(algorithm_default_spec(d.algorithm, input_shape, num_classes, tier)), f"default {tier} model"


def admit(d: RunDescriptor, profile: Any, *, node_id: str, model_params: int | None = None,
          input_shape: Any = None, num_classes: int | None = None,
          node_model: Mapping[str, Any] | None = None) -> str | None:
    """Check a run against this device's profile and resources.

    Returns ``None`` to accept, else the decline reason, e.g. ``"algorithm dechw not
    allowed by profile pi-zero"`` or ``"model too large for memory_budget_mb: ..."``.
    Gating (battery, windows) is not a decline: a gated device accepts and pauses.

    Memory: the model's parameter count Φ (``model_params``, else
    :func:`run_model_params` from the descriptor's model, the node's ``[model]``, or the
    default model for the profile's tier) times the copies the algorithm holds at once
    (:func:`dfl_agent.profiles.behaviour.algorithm_need_mb`: weights, gradients, optimiser
    state, neighbours' models) plus 64 MiB must fit ``compute.memory_budget_mb``.
    """
    from dfl_agent.algorithms.base import get_algorithm
    from dfl_agent.profiles.behaviour import algorithm_need_mb, models_held

    try:
        get_algorithm(d.algorithm)
    except (KeyError, ValueError) as exc:
        return f"unknown algorithm {d.algorithm!r}: {exc}"
    if getattr(profile, "inference_only", False):
        return f"profile {profile.name} is inference-only"
    allowed = getattr(getattr(profile, "behaviour", None), "algorithms", None)
    if allowed and d.algorithm not in allowed:
        return f"algorithm {d.algorithm} not allowed by profile {profile.name}"
    source = "given"
    if model_params is None:
        try:
            model_params, source = run_model_params(d, profile, input_shape=input_shape, num_classes=num_classes,
                                                    node_model=node_model)
        except (ValueError, TypeError, KeyError) as exc:
            return f"invalid model: {exc}"
    budget = getattr(getattr(profile, "compute", None), "memory_budget_mb", None)
    try:
        need = algorithm_need_mb(d.algorithm, model_params)
        copies = f"{models_held(d.algorithm):g} copies"
    except KeyError:  # an algorithm the decision table does not know: weights, gradients, momentum, 5 peers
        need, copies = 8 * model_params * 4 / 2**20 + 64.0, "8 copies"
    if budget and need > budget:
        return (f"model too large for memory_budget_mb: {model_params} parameters ({source}), "
                f"~{need:.0f} MiB for {copies} of it, budget {budget} MiB")
    return None


# -- signing ---------------------------------------------------------------------
def operator_certificate(federation_key: Any, federation: str, name: str, public_b64: str,
                         valid_days: float | None = None) -> dict[str, Any]:
    """An operator certificate (version 2, ``role = "operator"``) signed by the federation key
    (what ``dflctl keys enroll NAME --role operator`` writes)."""
    from dfl_agent.security.keys import issue_certificate

    return issue_certificate(federation_key, federation, name, public_b64, valid_days=valid_days, role="operator")


def run_kind(run_id: str) -> str:
    """The control-envelope ``kind`` of run ``run_id``'s descriptor: ``"run:{run_id}"``.

    Sequence numbers are per (sender, kind) (:class:`~dfl_agent.security.trust.SecurityGuard`),
    so each run has its own: the retained descriptors of several runs may reach a device in
    any order, and only a newer copy of the *same* run (a cancel) must carry a higher one."""
    return f"run:{run_id}"


def sign_descriptor(d: RunDescriptor, key: Any | None, signer: str = "", cert: dict[str, Any] | None = None,
                    seq: Any = None) -> bytes:
    """The retained message for ``d``: a signed control envelope of kind :func:`run_kind`
    (:meth:`~dfl_agent.security.trust.SecurityGuard.sign_control`, the same envelope as
    presence and status) whose payload is the descriptor, sent by ``signer`` with its
    ``cert``; unsigned (``sig`` null) when ``key`` is None.

    Args:
        seq: a :class:`~dfl_agent.security.trust.SeqCounter` (persist it, e.g. in the
            operator's folder); None counts from the clock in milliseconds, which also
            grows from one ``dflctl`` call to the next.
    """
    from dfl_agent.security.trust import SecurityGuard, SeqCounter, TrustStore

    guard = SecurityGuard(signer or "anonymous", key, TrustStore(d.federation), certificate=cert,
                          seq=seq if seq is not None else SeqCounter(None))
    return guard.sign_control(run_kind(d.run_id), d.to_dict(), d.federation)


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
_REFUSAL = {"unknown_sender": "unknown_key", "wrong_kind": "malformed", "wrong_sender": "malformed"}


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
                 operators: Mapping[str, str] | None = None, guard: Any = None):
        from dfl_agent.security.trust import SecurityGuard, TrustStore

        self.federation = federation
        self.require_signatures = require_signatures
        if guard is None:
            guard = SecurityGuard("", None, TrustStore(federation, operators=dict(operators or {}),
                                                       federation_key=federation_key),
                                  require_signatures=require_signatures)
        self.guard = guard
        self.refused: dict[str, int] = {}

    def check(self, payload: bytes) -> tuple[RunDescriptor | None, str | None]:
        """``(descriptor, None)`` when usable, else ``(None, reason)`` with the reason one
        of :data:`REFUSE_REASONS` (counted in :attr:`refused`), or ``"duplicate"`` for the
        very message accepted last, delivered again (not counted)."""
        d, why = self._check(payload)
        if why is not None and why != "duplicate":
            self.refused[why] = self.refused.get(why, 0) + 1
        return d, why

    def _check(self, payload: bytes) -> tuple[RunDescriptor | None, str | None]:
        from dfl_agent.security.trust import ControlRejected

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


# -- hooks ------------------------------------------------------------------------
RunHook = Callable[[RunDescriptor, Any], Any]


class RunHooks:
    """Callbacks around runs.  ``on_run_finished(run, node)`` is called after a run
    ends on this node with state ``finished`` (``node`` is the :class:`~dfl_agent.runtime.node.Node`
    that trained it; its algorithm holds the final model) - e.g. to deploy the model.
    A hook that raises is logged; it never stops the agent."""

    def __init__(self) -> None:
        self.finished: list[RunHook] = []

    def on_run_finished(self, fn: RunHook) -> RunHook:
        """Register ``fn(run, node)``; usable as a decorator."""
        self.finished.append(fn)
        return fn

    def fire_finished(self, run: RunDescriptor, node: Any) -> None:
        for fn in list(self.finished):
            try:
                fn(run, node)
            except Exception:
                log.exception("on_run_finished hook %r failed", fn)


def default_descriptor(cfg: Any, now: float | None = None, ledger: RunLedger | None = None,
                       new_samples: Callable[[int], int] | None = None) -> RunDescriptor | None:
    """The node's default run from its ``[algorithm]`` section (None when it has none, or
    when a run recurring on new samples is not due).

    Its id is :func:`default_run_id`; with ``algorithm.every`` the current period's
    :func:`recurring_run_id`; with ``algorithm.every_samples`` the due
    :func:`next_sample_triggered` repeat (needs ``ledger`` and ``new_samples``, the
    store's :meth:`~dfl_agent.store.sqlite.SampleStore.count_since`)."""
    a = getattr(cfg, "algorithm", None)
    if a is None:
        return None
    every_samples = getattr(a, "every_samples", None)
    settings = {"algorithm": a.name, "options": dict(a.options), "rounds": a.rounds,
                "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None},
                "training": {k: v for k, v in dataclasses.asdict(cfg.training).items() if v is not None},
                "compression": {k: v for k, v in dataclasses.asdict(cfg.compression).items() if v is not None}}
    rid = default_run_id(cfg.federation, settings)
    every = getattr(a, "every", None)
    if every:
        rid = recurring_run_id(rid, period_index(time.time() if now is None else now, parse_duration(every)))
    elif every_samples and ledger is not None and new_samples is not None:
        due = next_sample_triggered(ledger, rid, int(every_samples), new_samples)
        if due is None:
            return None
        rid = due
    return RunDescriptor(run_id=rid, federation=cfg.federation, algorithm=a.name, rounds=a.rounds,
                         name="default", options=dict(a.options), default=True)


class RunLobby:
    """The always-on side of a node: listens for run descriptors (``dfl/{fed}/run/+``,
    retained) and peers' statuses, and publishes this node's status while it is not
    training (``state = "idle"``, ``run = {id, state, round, reason}`` of the last run).

    It uses its own MQTT connection (client id ``dfl-{fed}-{node}-runs-...``) and never
    publishes presence: an idle node is not a member of any run's rounds.

    Args:
        cfg: the node's :class:`~dfl_agent.runtime.config.NodeConfig`.
        node_id: this node.
        verifier: :class:`RunVerifier` for descriptors.
    """

    def __init__(self, cfg: Any, node_id: str, verifier: RunVerifier):
        import threading

        self.cfg, self.node_id, self.verifier = cfg, node_id, verifier
        self.queue = RunQueue()
        self.statuses: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.client: Any = None
        self.heartbeat = 0
        self.connected = threading.Event()
        #: SecurityGuard signing this node's statuses and verifying peers' ones (None: bare JSON)
        self.guard: Any = None
        #: statuses dropped by reason (``status_{reason}``), and ``handler_error``: messages
        #: whose handling raised (caught, counted, logged; the listener goes on)
        self.dropped: dict[str, int] = {}
        self._errors = RateLimitedLog(log)
        #: called with the run id, on the MQTT thread, as soon as a cancelled copy of a
        #: run arrives (the agent stops that run's training at once)
        self.on_cancel: Callable[[str], None] | None = None

    def start(self) -> None:
        """Connect (non-blocking; paho reconnects on its own)."""
        import secrets

        import paho.mqtt.client as mqtt

        from dfl_agent.discovery.static import parse_endpoint
        from dfl_agent.transport.mqtt import PROTOCOLS

        m = self.cfg.mqtt
        host, port = parse_endpoint(m.broker)
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                        client_id=f"dfl-{self.cfg.federation}-{self.node_id}-runs-{secrets.token_hex(3)}",
                        protocol=PROTOCOLS[m.protocol])
        if m.username is not None:
            c.username_pw_set(m.username, m.password)
        if m.tls_ca is not None:
            import ssl

            c.tls_set(ca_certs=m.tls_ca, certfile=m.tls_cert, keyfile=m.tls_key, cert_reqs=ssl.CERT_REQUIRED,
                      tls_version=ssl.PROTOCOL_TLS_CLIENT)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        c.connect_async(host, port, keepalive=m.keepalive)
        c.loop_start()
        self.client = c

    def stop(self) -> None:
        """Disconnect."""
        if self.client is not None:
            self.client.disconnect()
            self.client.loop_stop()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        from dfl_agent.transport.mqtt import topic

        if getattr(reason_code, "is_failure", False):
            log.warning("run lobby: connection refused: %s", reason_code)
            return
        client.subscribe([(run_topic(self.cfg.federation), 1), (topic(self.cfg.federation, "+", "status"), 1)])
        self.connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        """paho's message callback: whatever one message does, the listener thread goes on
        (an exception is counted as ``handler_error`` and logged, rate-limited)."""
        try:
            self._handle_message(msg)
        except Exception:  # noqa: BLE001 - never end the run listener thread
            with self.lock:
                self.dropped["handler_error"] = self.dropped.get("handler_error", 0) + 1
            self._errors.exception("run lobby: error handling a message on %s", getattr(msg, "topic", "?"))

    def _handle_message(self, msg: Any) -> None:
        parts = msg.topic.split("/")
        if len(parts) == 4 and parts[2] == "run":
            if not msg.payload:
                return
            d, why = self.verifier.check(msg.payload)
            if why is not None:
                if why != "duplicate":
                    log.warning("refused run descriptor on %s: %s", msg.topic, why)
                return
            assert d is not None
            if d.run_id != parts[3]:
                self.verifier.refused["malformed"] = self.verifier.refused.get("malformed", 0) + 1
                return
            with self.lock:
                fresh = self.queue.offer(d)
                if fresh:
                    log.info("run %s (%s, %d rounds, submitted by %s)%s", d.run_id, d.algorithm, d.rounds,
                             d.submitter or "?", " cancelled" if d.cancelled else "")
                    self.changed.set()
            hook = self.on_cancel
            if fresh and d.cancelled and hook is not None:
                try:
                    hook(d.run_id)
                except Exception:
                    log.exception("cancel hook failed")
        elif len(parts) == 5 and parts[4] == "status":
            st = self._open_status(parts[3], msg.payload)
            if st is False:
                return
            with self.lock:
                if isinstance(st, dict):
                    self.statuses[parts[3]] = st
                else:
                    self.statuses.pop(parts[3], None)

    def _open_status(self, node: str, payload: bytes) -> Any:
        """A peer's status dict, None (cleared), or False (dropped and counted): verified
        with :attr:`guard` when set - with ``require_signatures`` only a trusted device's
        signed status counts (``accepted_by`` decides ``min_members`` on it)."""
        from dfl_agent.security.trust import ControlRejected

        if node == self.node_id:
            return False
        guard = self.guard
        if guard is None or not payload:
            if not payload:
                return False if guard is not None and guard.require_signatures else None
            try:  # bounded: 64 KiB, nesting depth 32
                st = bounded_loads(payload, "status")
            except JSONBoundError as exc:
                key = f"status_{exc.reason}"
                with self.lock:
                    self.dropped[key] = self.dropped.get(key, 0) + 1
                return False
            return st.get("payload") if isinstance(st, dict) and "ctl" in st else st
        try:
            _s, role, st = guard.verify_control(payload, "status", node)
        except ControlRejected as exc:
            if exc.reason != "duplicate":
                key = f"status_{exc.reason}"
                self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        if guard.require_signatures and role != "device":
            self.dropped["status_not_member"] = self.dropped.get("status_not_member", 0) + 1
            return False
        return st

    def run(self, run_id: str) -> RunDescriptor | None:
        """The newest known descriptor of ``run_id``."""
        with self.lock:
            return self.queue.runs.get(run_id)

    def declined_by(self, run_id: str) -> set[str]:
        """Nodes whose status (its current run, or its run history) says they declined ``run_id``."""
        out = set()
        with self.lock:
            for n, s in self.statuses.items():
                r = s.get("run")
                hist = s.get("run_history")
                if isinstance(r, dict) and r.get("id") == run_id:
                    state = r.get("state")
                elif isinstance(hist, dict) and isinstance(hist.get(run_id), dict):
                    state = hist[run_id].get("state")
                else:
                    continue
                if state == "declined":
                    out.add(n)
        return out

    def may_join(self, run_id: str) -> int:
        """How many other known nodes may still join ``run_id``: every node with a verified
        status except those that declined it (a node that declined is not waited for).
        Unbounded (``sys.maxsize``) while no node declined: statuses may still be arriving."""
        import sys

        declined = self.declined_by(run_id)
        if not declined:
            return sys.maxsize
        with self.lock:
            return len(set(self.statuses) - declined)

    def accepted_by(self, run_id: str) -> set[str]:
        """Nodes whose status says they accepted or train ``run_id``."""
        with self.lock:
            return {n for n, s in self.statuses.items() if isinstance(s.get("run"), dict)
                    and s["run"].get("id") == run_id and s["run"].get("state") in ("accepted", "training")}

    def publish_status(self, run: dict[str, Any] | None, state: str = "idle",
                       history: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Publish this node's status (retained) while no run trains; ``history`` (run id
        -> ledger entry, the newest 20 kept) lets ``dflctl run list`` show finished runs."""
        from dfl_agent.transport.mqtt import topic

        if self.client is None:
            return
        self.heartbeat += 1
        st = {"node_id": self.node_id, "state": state, "time": time.time(), "heartbeat": self.heartbeat,
              "run": run, "runs_refused": dict(self.verifier.refused), "algorithm": None, "round": 0,
              "run_history": {k: {f: v.get(f) for f in ("state", "round", "reason")}
                              for k, v in sorted((history or {}).items(), key=lambda kv: kv[1].get("time", 0))[-20:]}}
        if self.dropped:
            st["control_dropped"] = dict(self.dropped)
        body = self.guard.sign_control("status", st, self.cfg.federation) if self.guard is not None else json.dumps(st)
        self.client.publish(topic(self.cfg.federation, self.node_id, "status"), body, qos=1, retain=True)
