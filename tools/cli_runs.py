"""``dflctl run``: submit, list, show and cancel the runs of a federation.

A run is a signed, retained descriptor on ``dfl/{fed}/run/{run_id}`` (see
:mod:`dfl_agent.runtime.shared.descriptor`).  ``submit`` and ``cancel`` sign it with the operator's
key and certificate (``--operator-dir DIR`` holding ``*.pem`` and ``*cert*.json``, as
``dflctl keys`` writes them); ``list`` and ``show`` read the descriptors and the
nodes' statuses (each carries ``run = {id, state, round, reason}``).  ``cancel`` also
publishes the run's retained cancel record (``dfl/{fed}/run/{run_id}/cancel``), so the run
stays cancelled even when an old copy of its submission is published again; ``list`` and
``show`` show a run with a cancel record as ``cancelled``.

Trust: with ``--config`` (a node.toml's ``[security]`` trust material) ``list`` and
``show`` verify every descriptor as an agent with ``require_signatures`` does
(:class:`~dfl_agent.runtime.shared.descriptor.RunVerifier`) and show only those an operator signed
(``trust = "operator"``); the others are hidden and counted on one line of stderr.
Without it every entry is marked ``trust = "unverified"``, as ``dflctl peers`` does.

What happened is what is said: ``submit`` and ``cancel`` send nothing unsigned to a federation
whose devices require signed runs (:func:`signatures_required`: the devices' statuses, else
``--config``), nor signed with a certificate that is not an operator's (exit 2, naming
``--operator-dir``); a publish the broker refuses (an MQTT 5 PUBACK reason code such as 0x87
not authorized) is one line with the broker's reason, exit 1.  After publishing, ``submit``
waits up to ``--wait`` s for the devices' answers in their statuses (:func:`run_answers`:
accepted, queued, declined, refused with the reason) and exits 1 when every device that
answered refused the run; Ctrl-C says whether the run was published (exit 130).  ``cancel``
of a run every member already finished is refused (exit 1, nothing sent); a device refuses a
cancel that reaches it after its last round (it deploys and records the run finished), and
``show`` says ``finished`` when every member's ledger does.

Connection: every sub-command takes the fleet options of :mod:`dfl_agent.cli.fleet`
(``--config`` or ``--broker``, ``--federation``, ``-u``, ``--password-file``, ``--cafile``,
``--cert``, ``--key``); a broker that cannot be used is one line saying why, exit 3.
``list`` and ``show`` on a federation that nothing is heard from (no presence, status or run)
name the federations the broker carries, exit 1.
"""

from __future__ import annotations

import argparse
import collections
import json
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.fleet import publish_retained
from dfl_agent.runtime.shared.degraded import alone_text, degraded_fields

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.cli.dflctl import DflctlParser
    from dfl_agent.cli.fleet import FleetTarget
    from dfl_agent.cli.observer import Observer
    from dfl_agent.runtime.shared.config import NodeConfig
    from dfl_agent.runtime.shared.descriptor import RunDescriptor
    from dfl_agent.security.trust import SecurityGuard, SeqCounter

RUN_COLUMNS = ("run_id", "name", "state", "algorithm", "rounds", "submitter", "trust", "nodes")


def _target(a: argparse.Namespace) -> FleetTarget:
    from dfl_agent.cli.fleet import target

    return target(a)


def load_operator(d: str | None) -> tuple[Ed25519PrivateKey | None, dict[str, Any] | None, str]:
    """The operator's ``(private key, certificate or None, name)`` from ``d`` (None: unsigned).

    Raises:
        FileNotFoundError: no ``*.pem`` key in ``d``.
    """
    if d is None:
        return None, None, ""
    from dfl_agent.security.keys import load_certificate, load_private_key

    p = Path(d)
    keys = sorted(p.glob("*key*.pem")) or sorted(p.glob("*.pem"))
    keys = [k for k in keys if "federation" not in k.name]
    if not keys:
        raise FileNotFoundError(f"{p}: no operator key (*.pem)")
    certs = sorted(p.glob("*cert*.json"))
    cert = load_certificate(certs[0]) if certs else None
    name = str((cert or {}).get("node_id") or (cert or {}).get("name") or p.name)
    return load_private_key(keys[0]), cert, name


#: the operator's run sequence numbers, in the --operator-dir folder (not the devices'
#: control_seq.json: a folder that is also a device's state directory keeps both apart)
OPERATOR_SEQ_FILE = "operator_seq.json"


def operator_seq(d: str | None) -> SeqCounter:
    """The operator's control sequence counter, persisted in ``d/operator_seq.json`` when
    that folder is writable (else counted from the clock, which also grows)."""
    import os

    from dfl_agent.security.trust import SeqCounter

    if d is not None and os.access(d, os.W_OK):
        return SeqCounter(Path(d) / OPERATOR_SEQ_FILE)
    return SeqCounter(None)


def verify_runs(runs: dict[str, dict[str, Any]], payloads: dict[str, bytes], federation: str,
                guard: SecurityGuard | None, cancels: dict[str, bytes] | None = None
                ) -> tuple[dict[str, dict[str, Any]], collections.Counter[str]]:
    """The runs to show, each with its ``trust``, and the hidden ones counted by reason.

    Without ``guard`` (no ``--config``, or one naming neither a federation key nor
    operators) every run is kept with ``trust = "unverified"``.
    With ``guard`` (a verifying-only SecurityGuard, :func:`dfl_agent.cli.fleet.observer_guard`)
    each raw retained message in ``payloads`` goes through a
    :class:`~dfl_agent.runtime.shared.descriptor.RunVerifier` with ``require_signatures``, as an agent
    checks it: only descriptors signed by an operator of the federation (a pinned
    operator key, or an operator certificate from the federation key), for this
    federation, whose run id matches their topic, are kept (``trust = "operator"``); the
    others are counted under the verifier's refusal reason (``unsigned``,
    ``unknown_key``, ``not_operator``, ``bad_signature``, ``malformed``, ``too_deep``...).
    A shown run whose cancel record (``cancels``: run id -> raw retained record) verifies
    the same way (any record without ``guard``) gets ``cancel_record = True``.
    """
    hidden: collections.Counter[str] = collections.Counter()
    cancels = cancels or {}
    if guard is None:
        return {rid: {**m, "trust": "unverified", "cancel_record": rid in cancels} for rid, m in runs.items()}, hidden
    from dfl_agent.runtime.shared.descriptor import RunVerifier

    verifier = RunVerifier(federation, require_signatures=True, guard=guard)
    shown: dict[str, dict[str, Any]] = {}
    for rid, m in runs.items():
        d, why = verifier.check(payloads.get(rid, b""))
        if d is not None and d.run_id != rid:
            why = "malformed"  # a descriptor republished on another run's topic
        if d is None or why is not None:
            hidden[why or "malformed"] += 1
            continue
        cancelled = rid in cancels and verifier.check_cancel(cancels[rid], rid) is None
        shown[rid] = {**m, "trust": "operator", "descriptor": {**m.get("descriptor", {}), "submitter": d.submitter},
                      "cancel_record": cancelled}
    return shown, hidden


def _snapshot(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], collections.Counter[str]]:
    """Runs (verified with ``--config``'s trust material, else marked unverified),
    statuses, and the runs hidden because they did not verify (by reason).

    Raises:
        dfl_agent.cli.fleet.FederationAbsent: no presence, status or run of the federation.
    """
    from dfl_agent.cli import fleet
    from dfl_agent.cli.observer import Observer

    t = _target(a)
    obs = Observer(t).start(timeout=a.timeout)
    obs.settle()
    statuses, presence = obs.snapshot()
    shown, hidden = observed_runs(obs, t)
    obs.stop()
    if not (shown or hidden or statuses or presence):
        raise fleet.FederationAbsent(fleet.absent(t, "presence, status or run"))
    return shown, statuses, hidden


def observed_runs(obs: Observer, t: FleetTarget) -> tuple[dict[str, dict[str, Any]], collections.Counter[str]]:
    """The runs an :class:`~dfl_agent.cli.observer.Observer` holds, verified with the trust
    material of ``t``'s ``--config`` (:func:`verify_runs`; unverified without it), and the
    hidden ones counted by reason.  ``run list`` and ``watch`` show the same runs."""
    from dfl_agent.cli import fleet

    guard = None
    if t.config is not None and (t.config.security.federation_key or t.config.security.operators):
        guard = fleet.trust_guard(t)  # trust material for operators
        revocations = getattr(obs, "revocations_payload", None)
        if guard is not None and revocations:  # a revoked operator's runs: hidden
            guard.trust.revocations.offer(revocations, count=False)
    with obs._lock:
        runs, payloads, cancels = dict(obs.runs), dict(obs.run_payloads), dict(obs.run_cancels)
    return verify_runs(runs, payloads, t.federation, guard, cancels)


def _say_hidden(cmd: str, hidden: collections.Counter[str]) -> None:
    if hidden:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(hidden.items()))
        print(f"dflctl run {cmd}: {sum(hidden.values())} run descriptor(s) hidden: not signed by an operator "
              f"of the federation ({why})", file=sys.stderr)


def run_view(run_id: str, msg: dict[str, Any], statuses: dict[str, Any]) -> dict[str, Any]:
    """The JSON of ``dflctl run show``: descriptor fields plus each node's view of the run
    (``nodes: {id: {state, round, reason, started_from, epsilon, peak_rss_mb, model, version,
    adopted_from, degraded, rounds_alone, exchange_rounds}}``, ``model`` how the run's model ended
    on the node (``deployed``, ``adopted`` from the member ``adopted_from``, ``kept``; None: not
    said), ``version`` the version it installed, ``started_from`` the deployed version the node's run started from:
    its warm start; ``epsilon`` the run's privacy spend on the node under DP (None without);
    ``peak_rss_mb`` the peak resident memory of the node's run process (MiB; None until it ended);
    ``degraded`` when the node closed rounds of it alone) and an overall ``state``."""
    d = msg.get("descriptor") or {}
    nodes: dict[str, dict[str, Any]] = {}
    for nid, st in sorted(statuses.items()):
        r = st.get("run") if isinstance(st, dict) else None
        hist = st.get("run_history") if isinstance(st, dict) else None
        entry = hist.get(run_id) if isinstance(hist, dict) and isinstance(hist.get(run_id), dict) else None
        if not (isinstance(r, dict) and r.get("id") == run_id):
            r = {**entry, "id": run_id} if entry is not None else None
        if isinstance(r, dict) and r.get("id") == run_id:
            # degraded: a training node's status counts, else the run's ledger entry (run_history)
            counts = st if "rounds_alone" in st and st.get("state") != "idle" else entry or {}
            nodes[nid] = {"state": r.get("state", ""), "round": r.get("round", 0) or 0,
                          "reason": r.get("reason", "") or "", "started_from": r.get("started_from"),
                          "epsilon": ((entry or {}).get("privacy") or r.get("privacy") or {}).get("epsilon"),
                          "peak_rss_mb": (entry or {}).get("peak_rss_mb"),
                          **{k: r.get(k, (entry or {}).get(k)) for k in ("model", "version", "adopted_from")},
                          **degraded_fields(counts)}
    states = {n["state"] for n in nodes.values()}
    if states and states <= {"finished", "declined", "missed"} and "finished" in states:
        state = "finished"  # what the members' ledgers say, also when a cancel came after they finished
    elif d.get("cancelled") or msg.get("cancel_record"):
        state = "cancelled"
    elif "training" in states:
        state = "training"
    elif states and states <= {"failed", "declined", "cancelled"}:
        state = "failed" if "failed" in states else ("declined" if states == {"declined"} else "cancelled")
    elif states:
        state = "starting"
    else:
        state = "queued"
    return {"schema_version": 1, "run_id": run_id, "name": d.get("name", ""), "state": state,
            "algorithm": d.get("algorithm"), "rounds": d.get("rounds"), "options": d.get("options", {}),
            "members": d.get("members"), "min_members": d.get("min_members"), "submitter": d.get("submitter"),
            "submitted_at": d.get("submitted_at"), "not_after": d.get("not_after"), "init": d.get("init"),
            "cancel_record": bool(msg.get("cancel_record")), "signed": msg.get("sig") is not None,
            "trust": msg.get("trust", "unverified"), "verified": msg.get("trust") == "operator", "nodes": nodes}


def model_text(node: dict[str, Any]) -> str:
    """How the run's model ended on a node, for ``dflctl run show`` (``""`` when its status does
    not say): ``  model v3 deployed``, ``  model v3 adopted from p1``, ``  model kept``."""
    how, v = node.get("model"), node.get("version")
    if how not in ("deployed", "adopted", "kept"):
        return ""
    ver = f" v{v}" if isinstance(v, int) and not isinstance(v, bool) and how != "kept" else ""
    src = f" from {node['adopted_from']}" if how == "adopted" and node.get("adopted_from") else ""
    return f"  model{ver} {how}{src}"


def run_rows(runs: dict[str, Any], statuses: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run, in queue order (``submitted_at``, then ``run_id``)."""
    views = [run_view(rid, m, statuses) for rid, m in runs.items()]
    views.sort(key=lambda v: (float(v.get("submitted_at") or 0), v["run_id"]))
    return [{**{k: v[k] for k in RUN_COLUMNS if k in v},
             "nodes": ", ".join(f"{n}:{x['state']}@{x['round']}{' degraded' if x['degraded'] else ''}"
                                for n, x in v["nodes"].items())} for v in views]


def _pairs(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` arguments as a dict, each value parsed as JSON when it is JSON
    (``3`` -> 3, ``true`` -> True), else kept as text.

    Raises:
        ValueError: an item without ``=`` or without a key (the message names ``flag``).
    """
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def signatures_required(statuses: dict[str, Any], cfg: NodeConfig | None = None) -> str | None:
    """Why a run for this federation must be signed by an operator, or None.

    The devices' own word comes first: every status of an always-on agent says
    ``signatures_required`` (its ``security.require_signatures``: it refuses runs that no
    operator signed), so this holds whatever configuration the operator has at hand.  For
    devices of an older release, which do not say, ``cfg`` (``--config``) with
    ``security.require_signatures`` counts.  Statuses are read unverified: a forged one
    can only make ``dflctl`` refuse to send unsigned, never the reverse."""
    says = sorted(n for n, st in statuses.items() if isinstance(st, dict) and st.get("signatures_required") is True)
    if says:
        names = ", ".join(says[:5]) + (", ..." if len(says) > 5 else "")
        return f"{len(says)} of its {len(statuses)} device(s) require signed runs ({names})"
    if cfg is not None and getattr(cfg.security, "require_signatures", False):
        return "security.require_signatures of --config is on"
    return None


def operator_refusal(cmd: str, why: str | None, key: Ed25519PrivateKey | None, cert: dict[str, Any] | None, d: str | None) -> str | None:
    """The one line (exit 2) when ``dflctl run CMD`` must not send: the federation requires
    signed runs (``why``, :func:`signatures_required`) and ``--operator-dir`` is missing, or
    holds a certificate whose role is not ``operator`` (a device's folder); None otherwise."""
    if why is None:
        return None
    hint = "the folder of an operator's key and certificate (dflctl keys enroll NAME --role operator)"
    if key is None:
        return (f"dflctl run {cmd}: the federation's devices refuse unsigned runs ({why}); nothing was sent: "
                f"give --operator-dir, {hint}")
    if cert is not None:
        from dfl_agent.security.keys import certificate_role

        try:
            role = certificate_role(cert)
        except Exception:  # noqa: BLE001 - an unreadable role is no operator's
            role = "unknown"
        if role != "operator":
            who = cert.get("node_id") or "?"
            return (f"dflctl run {cmd}: --operator-dir {d} holds the certificate of {who} with role {role!r}, not "
                    f"'operator': the devices refuse runs it signs ({why}); nothing was sent: give {hint}")
    return None


#: a node's answer to a submitted run, from its status: run state -> answer
_ANSWER = {"accepted": "accepted", "waiting_for_members": "accepted", "training": "accepted",
           "trained": "accepted", "deploying": "accepted", "finished": "accepted", "declined": "declined",
           "failed": "failed", "cancelled": "cancelled", "missed": "accepted"}
#: answers that mean the node will not run it (every answering member so: exit 1)
REFUSALS = ("declined", "failed", "refused")
#: a node's decline of a run it is not a member of (not counted as a refusal)
NOT_MEMBER = "not a member of this run"


def run_answers(run_id: str, statuses: dict[str, Any], baseline: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """Each node's answer to run ``run_id`` so far, from its status (nodes that have not
    answered are left out): ``{"answer": "accepted" | "queued" | "declined" | "failed" |
    "refused" | "not a member" | "cancelled", "reason": str}``.  ``accepted``: the run is
    the node's current run or in its run history (admitted, training, ...); ``queued``: in its
    ``runs_queued``, behind another run; ``refused``: the node's ``runs_refused`` counters
    grew since ``baseline`` (node -> counters before the run was published), the reasons
    those that grew (``unsigned``, ``unknown_key``, ``not_operator``, ``expired``...)."""
    out: dict[str, dict[str, str]] = {}
    for nid, st in sorted(statuses.items()):
        if not isinstance(st, dict):
            continue
        r, hist = st.get("run"), st.get("run_history")
        entry = r if isinstance(r, dict) and r.get("id") == run_id else (
            hist.get(run_id) if isinstance(hist, dict) and isinstance(hist.get(run_id), dict) else None)
        if entry is not None and entry.get("state") in _ANSWER:
            answer, reason = _ANSWER[str(entry["state"])], str(entry.get("reason") or "")
            if answer == "declined" and reason == NOT_MEMBER:
                answer, reason = "not a member", ""
            out[nid] = {"answer": answer, "reason": reason}
            continue
        queued = st.get("runs_queued")
        if isinstance(queued, list) and run_id in queued:
            busy = r.get("id") if isinstance(r, dict) and st.get("state") not in (None, "idle") else None
            out[nid] = {"answer": "queued", "reason": f"behind run {busy}" if busy else ""}
            continue
        before, now = baseline.get(nid), st.get("runs_refused")
        if before is not None and isinstance(now, dict):
            grew = sorted(k for k, v in now.items() if isinstance(v, int) and v > int(before.get(k, 0) or 0))
            if grew:
                out[nid] = {"answer": "refused", "reason": ", ".join(grew)}
    return out


def _answering(statuses: dict[str, Any], presence: dict[str, Any]) -> list[str]:
    """The nodes expected to answer a submission: those with a status that ``dflctl peers``
    shows neither offline nor stale."""
    from dfl_agent.cli.tables import peer_rows

    return [r["node_id"] for r in peer_rows(statuses, presence)
            if r["node_id"] in statuses and r["state"] not in ("offline", "stale", "unknown")]


def wait_answers(obs: Observer, run_id: str, baseline: dict[str, dict[str, int]], expected: list[str],
                 wait: float) -> tuple[dict[str, dict[str, str]], float]:
    """Poll ``obs`` (a started :class:`~dfl_agent.cli.observer.Observer`) until every node of
    ``expected`` answered run ``run_id`` (:func:`run_answers`) or ``wait`` s passed; returns
    the answers (of any node) and the seconds waited."""
    t0 = time.monotonic()
    while True:
        answers = run_answers(run_id, obs.snapshot()[0], baseline)
        waited = time.monotonic() - t0
        if set(expected) <= set(answers) or waited >= wait:
            return answers, waited
        time.sleep(0.1)


class _Submission:
    """How far ``run submit`` got (what an interruption reports): ``"before"`` nothing sent,
    ``"sending"`` the run is on its way (the broker may have it), ``"published"``."""

    def __init__(self) -> None:
        self.phase, self.run_id = "before", ""


def cmd_submit(a: argparse.Namespace) -> int:
    sub = _Submission()
    try:
        return _submit(a, sub)
    except KeyboardInterrupt:  # Ctrl-C: say whether the run was published, exit 130 (docs/cli.md)
        rid = sub.run_id
        if sub.phase == "published":
            print(f"dflctl run submit: interrupted; run {rid} was published and stands (follow it: "
                  f"{follow_command(a, rid)}; cancel it: dflctl run cancel {rid} ...)", file=sys.stderr)
        elif sub.phase == "sending":
            print(f"dflctl run submit: interrupted while publishing run {rid}: the broker may have it; check with: "
                  f"{follow_command(a, rid)}", file=sys.stderr)
        else:
            print("dflctl run submit: interrupted; nothing was published", file=sys.stderr)
        return 130


def _submit(a: argparse.Namespace, sub: _Submission) -> int:
    from dfl_agent.cli import fleet
    from dfl_agent.cli.observer import Observer
    from dfl_agent.durations import parse_duration
    from dfl_agent.runtime.shared.descriptor import RunDescriptor, new_run_id, run_topic, sign_descriptor

    t = _target(a)
    fed = t.federation
    try:
        valid_for = parse_duration(a.not_after)
    except ValueError as exc:
        print(f"dflctl run submit: --not-after: {exc}", file=sys.stderr)
        return 2
    if a.wait < 0:
        print("dflctl run submit: --wait must be >= 0 seconds", file=sys.stderr)
        return 2
    try:
        key, cert, name = load_operator(a.operator_dir)
    except (OSError, ValueError) as exc:
        print(f"dflctl run submit: --operator-dir: {exc}", file=sys.stderr)
        return 2
    try:
        options, training = _pairs(a.option, "--option"), _pairs(a.training, "--training")
    except ValueError as exc:
        print(f"dflctl run submit: {exc}", file=sys.stderr)
        return 2
    model: dict[str, Any] = {}
    if a.model_size:
        model["size"] = a.model_size
    if a.models:
        model["family"] = a.models
    now = time.time()
    try:
        d = RunDescriptor.from_dict({
            "run_id": a.run_id or new_run_id(fed, a.algorithm, now, secrets.token_hex(4)), "federation": fed,
            "algorithm": a.algorithm, "rounds": a.rounds, "name": a.name or "", "options": options, "model": model,
            "training": training,
            "members": a.members.split(",") if a.members else "all", "min_members": a.min_members,
            "start_timeout": a.start_timeout, "submitter": name, "submitted_at": now, "seq": 1,
            "not_after": now + valid_for, "init": a.init,
        })
    except ValueError as exc:
        print(f"dflctl run submit: {exc}", file=sys.stderr)
        return 2
    sub.run_id = d.run_id
    try:  # what the federation's devices say before anything is sent: signatures, refusal counters
        obs = Observer(t).start(timeout=a.timeout)
    except ConnectionError as exc:
        print(f"dflctl run submit: {exc}", file=sys.stderr)
        return 3
    try:
        obs.settle()
        statuses, presence = obs.snapshot()
        refusal = operator_refusal("submit", signatures_required(statuses, t.config), key, cert, a.operator_dir)
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
        baseline = {n: {k: v for k, v in (st.get("runs_refused") or {}).items()}
                    for n, st in statuses.items() if isinstance(st, dict) and isinstance(st.get("runs_refused"), dict)}
        expected = _answering(statuses, presence)
        sub.phase = "sending"
        try:
            publish_retained(t, run_topic(fed, d.run_id),
                             sign_descriptor(d, key, name, cert, seq=operator_seq(a.operator_dir)), timeout=a.timeout)
        except fleet.PublishRefused as exc:
            print(f"dflctl run submit: {exc}; run {d.run_id} was not published", file=sys.stderr)
            return 1
        except ConnectionError as exc:
            print(f"dflctl run submit: {exc}", file=sys.stderr)
            return 3
        sub.phase = "published"
        heard = bool(statuses or presence)
        v = _say_submitted(a, t, d, signed=key is not None, heard=heard)
        if a.no_wait or a.wait == 0 or not expected:
            if a.json:
                print(json.dumps(v, indent=1))
            return 0
        if not a.json:
            print(f"waiting up to {a.wait:g} s for the answers of {len(expected)} device(s) (--no-wait: don't)",
                  file=sys.stderr)
        answers, waited = wait_answers(obs, d.run_id, baseline, expected, a.wait)
    finally:
        obs.stop()
    return _say_answers(a, v, answers, expected, waited)


def _say_answers(a: argparse.Namespace, v: dict[str, Any], answers: dict[str, dict[str, str]],
                 expected: list[str], waited: float) -> int:
    """Print the devices' answers (stderr; with ``--json`` in the document on stdout); 1 when
    every device that answered as a member refused the run, else 0."""
    silent = [n for n in expected if n not in answers]
    if a.json:
        print(json.dumps({**v, "answers": answers, "no_answer": silent, "waited_s": round(waited, 1)}, indent=1))
    else:
        lines = [f"  {n}: {x['answer']}{': ' + x['reason'] if x['reason'] else ''}" for n, x in answers.items()]
        lines += [f"  {n}: no answer within {a.wait:g} s" for n in silent]
        print(f"answers ({len(answers)} of {len(expected)} device(s) within {waited:.1f} s):\n" + "\n".join(lines),
              file=sys.stderr)
    members = [x["answer"] for x in answers.values() if x["answer"] != "not a member"]
    if members and all(x in REFUSALS for x in members):
        print(f"dflctl run submit: every device that answered refused run {v['run_id']}: it will not run",
              file=sys.stderr)
        return 1
    return 0


def follow_command(a: argparse.Namespace, run_id: str) -> str:
    """``dflctl run show RUN_ID`` with the connection options this command was given
    (never a password: a password file is named, not read)."""
    import shlex

    argv = ["dflctl", "run", "show", run_id]
    for opt, attr in (("--config", "config"), ("--broker", "broker"), ("--federation", "federation"),
                      ("-u", "username"), ("--password-file", "password_file"), ("--cafile", "cafile"),
                      ("--cert", "cert"), ("--key", "key")):
        if getattr(a, attr, None):
            argv += [opt, str(getattr(a, attr))]
    return shlex.join(argv)


def submitted_view(a: argparse.Namespace, t: FleetTarget, d: RunDescriptor, signed: bool) -> dict[str, Any]:
    """What ``run submit`` published: the run id, where, what, who must take part and until
    when a device may still start it, and the command that follows it."""
    return {"schema_version": 1, "run_id": d.run_id, "federation": t.federation, "broker": t.broker,
            "name": d.name, "algorithm": d.algorithm, "rounds": d.rounds, "members": d.members,
            "min_members": d.min_members, "start_timeout": d.start_timeout, "submitter": d.submitter,
            "signed": signed, "submitted_at": d.submitted_at, "not_after": d.not_after, "init": d.init,
            "follow": follow_command(a, d.run_id)}


def _say_submitted(a: argparse.Namespace, t: FleetTarget, d: RunDescriptor, signed: bool, heard: bool = True) -> dict[str, Any]:
    """``run submit``'s answer once the run is published: the run id alone on stdout
    (``RID=$(dflctl run submit ...)`` keeps working), what was submitted and how to follow it on
    stderr; with ``--json`` nothing yet (the caller prints the document of :func:`submitted_view`,
    returned here, with the devices' answers).  A federation with no node on the broker
    (``heard`` False) gets a note: the run waits there, retained, for the nodes to come."""
    from dfl_agent.cli import fleet

    v = submitted_view(a, t, d, signed)
    if not heard:
        try:
            seen = fleet.federations_seen(t, stop_at=t.federation)
        except (ConnectionError, ValueError):
            seen = {t.federation: set()}  # cannot tell: say nothing
        if t.federation not in seen:
            print(f"dflctl run submit: note: the run waits on the broker (retained) until nodes of federation "
                  f"{t.federation!r} come: {fleet.absent(t, seen=seen)}", file=sys.stderr)
    if a.json:
        return v
    print(d.run_id, flush=True)
    members = "all members" if d.members == "all" else f"members {', '.join(d.members)}"
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d.not_after)) if d.not_after else "never"
    print(f"submitted run {d.run_id}{f' ({d.name})' if d.name else ''} to federation {t.federation} on {t.broker}: "
          f"{d.algorithm}, {d.rounds} round{'s' if d.rounds != 1 else ''}, {members} (starts when {d.min_members} "
          f"accepted, fails if not within {d.start_timeout:g}s), not after {until}, "
          f"{'signed by ' + d.submitter if signed else 'unsigned'}\n"
          f"follow it: {v['follow']}", file=sys.stderr)
    return v


#: node run states after which nothing is left to cancel there
ENDED = ("finished", "declined", "failed", "cancelled", "missed")


def already_finished(view: dict[str, Any]) -> str | None:
    """For :func:`run_view`'s document: one line saying that every member already ended the run
    (each node that took it up ended it, at least one finished it: a cancel would change
    nothing), or None when a cancel may still stop it somewhere (or no node has it yet)."""
    nodes = view.get("nodes") or {}
    states = {n["state"] for n in nodes.values()}
    if not nodes or not states <= set(ENDED) or "finished" not in states:
        return None
    how = "finished" if states <= {"finished", "declined"} else "ended"
    return f"already {how} on every member (" + ", ".join(
        f"{nid}: {n['state']} round {n['round']}" for nid, n in nodes.items()) + ")"


def cmd_cancel(a: argparse.Namespace) -> int:
    from dfl_agent.cli import fleet
    from dfl_agent.cli.observer import Observer
    from dfl_agent.runtime.shared.descriptor import RunDescriptor, cancel_topic, run_topic, sign_cancel, sign_descriptor

    t = _target(a)
    fed = t.federation
    try:
        key, cert, name = load_operator(a.operator_dir)
    except (OSError, ValueError) as exc:
        print(f"dflctl run cancel: --operator-dir: {exc}", file=sys.stderr)
        return 2
    try:  # the run's retained descriptor and the members' statuses
        obs = Observer(t).start(timeout=a.timeout)
    except ConnectionError as exc:
        print(f"dflctl run cancel: {exc}", file=sys.stderr)
        return 3
    try:
        obs.settle()
        statuses, _ = obs.snapshot()
        with obs._lock:
            msg = obs.runs.get(a.run)
    finally:
        obs.stop()
    try:
        d = RunDescriptor.from_dict(msg["descriptor"] if msg else None)
    except (ValueError, TypeError):
        msg = None
    if msg is None:
        print(f"dflctl run cancel: no run {a.run!r} in federation {fed} on {t.broker}", file=sys.stderr)
        return 1
    refusal = operator_refusal("cancel", signatures_required(statuses, t.config), key, cert, a.operator_dir)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    done = already_finished(run_view(d.run_id, msg, statuses))
    if done:
        print(f"dflctl run cancel: run {d.run_id} {done}; nothing was sent", file=sys.stderr)
        return 1
    d.cancelled, d.seq = True, d.seq + 1
    seq = operator_seq(a.operator_dir)
    try:  # the cancel record first: it stays even when the descriptor is published again
        publish_retained(t, cancel_topic(fed, d.run_id), sign_cancel(fed, d.run_id, key, name, cert, seq=seq),
                         timeout=a.timeout)
        publish_retained(t, run_topic(fed, d.run_id), sign_descriptor(d, key, name, cert, seq=seq), timeout=a.timeout)
    except fleet.PublishRefused as exc:
        print(f"dflctl run cancel: {exc}; run {d.run_id} was not cancelled", file=sys.stderr)
        return 1
    except ConnectionError as exc:
        print(f"dflctl run cancel: {exc}", file=sys.stderr)
        return 3
    print(f"cancelled {d.run_id}")
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    runs, statuses, hidden = _snapshot(a)
    _say_hidden("list", hidden)
    if a.json:
        views = [run_view(r, m, statuses) for r, m in runs.items()]
        views.sort(key=lambda v: (float(v.get("submitted_at") or 0), v["run_id"]))
        print(json.dumps({"schema_version": 1, "runs": views, "hidden": dict(hidden)}, indent=1))
        return 0
    from dfl_agent.cli.output import console
    from dfl_agent.cli.tables import render_table

    console().print(render_table("runs", run_rows(runs, statuses), RUN_COLUMNS))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    runs, statuses, hidden = _snapshot(a)
    if a.run not in runs:
        _say_hidden("show", hidden)
        print(f"dflctl run show: no run {a.run!r}{' signed by an operator' if a.config else ''}", file=sys.stderr)
        return 1
    v = run_view(a.run, runs[a.run], statuses)
    if a.json:
        print(json.dumps(v, indent=1))
        return 0
    print(f"run {v['run_id']} ({v['name']}): {v['state']}, {v['algorithm']} x {v['rounds']} rounds, "
          f"submitted by {v['submitter'] or '?'}{'' if v['signed'] else ' (unsigned)'} [{v['trust']}]")
    init = v["init"] or "each node's runtime.run_init"
    print(f"  init: {init}")
    for nid, n in v["nodes"].items():
        start = "" if n.get("started_from") is None else f"  started from v{n['started_from']}"
        alone = f"  degraded: {alone_text(n)} (rounds with no peer update)" if n.get("degraded") else ""
        eps = "" if n.get("epsilon") is None else f"  epsilon {n['epsilon']:.3g}"
        mem = "" if n.get("peak_rss_mb") is None else f"  peak memory {n['peak_rss_mb']:.0f} MiB"
        print(f"  {nid}: {n['state']} round {n['round']}{model_text(n)}{start}{eps}{mem}{alone}"
              f"{'  ' + n['reason'] if n['reason'] else ''}")
    return 0


def cmd_enroll_operator(a: argparse.Namespace) -> int:
    from dfl_agent.cli.cli_security import _fed_key
    from dfl_agent.runtime.shared.descriptor import operator_certificate
    from dfl_agent.security.keys import load_or_create_key, public_key_b64, save_certificate

    try:
        fed_key = _fed_key(Path(a.dir))
    except (OSError, ValueError) as exc:
        print(f"dflctl run enroll-operator: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    key = load_or_create_key(out, str(out / "operator_key.pem"))
    cert = operator_certificate(fed_key, a.federation, a.name, public_key_b64(key), valid_days=a.valid_days)
    save_certificate(cert, out / "operator_cert.json")
    print(f"operator {a.name}: key {out / 'operator_key.pem'}, certificate {out / 'operator_cert.json'}")
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl run {submit,list,show,cancel}``."""
    r = sub.add_parser("run", help="submit, list, show and cancel runs of a federation")
    rs = r.add_subparsers(dest="run_cmd", required=True)

    from dfl_agent.cli.fleet import add_options

    def common(p: argparse.ArgumentParser) -> None:
        add_options(p, timeout=10.0)

    s = rs.add_parser("submit", help="publish a new run; prints its id (and on stderr what was submitted)")
    common(s)
    s.add_argument("--operator-dir", default=None,
                   help="folder with the operator's key (*.pem) and certificate (*cert*.json); omit to submit "
                        "unsigned: refused (exit 2, nothing sent) when the federation's devices require signed runs "
                        "(their status says so) or --config has security.require_signatures")
    s.add_argument("--algorithm", required=True, help="algorithm name (dflctl algorithms)")
    s.add_argument("--rounds", type=int, required=True, help="rounds to run")
    s.add_argument("--option", action="append", metavar="K=V", help="algorithm option (repeatable; V parsed as JSON)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--model-size", choices=["small", "medium", "large"], help="model size tier for every member")
    g.add_argument("--models", metavar="FAMILY", help="model family (each member takes its profile's tier)")
    s.add_argument("--training", action="append", metavar="K=V",
                   help="training setting for this run, overriding node.toml's [training] (repeatable), e.g. steps=200")
    s.add_argument("--members", default=None, help="comma-separated node ids (default: all)")
    s.add_argument("--min-members", type=int, default=1, help="devices that must accept before it starts")
    s.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for --min-members before the run fails")
    s.add_argument("--name", default=None, help="a human label")
    s.add_argument("--init", choices=["deployed", "fresh"], default=None,
                   help="where each member's model starts: its deployed model when the architecture matches "
                        "(deployed), or fresh weights (default: each node's runtime.run_init, itself deployed)")
    s.add_argument("--run-id", default=None, help="use this run id instead of a generated one")
    s.add_argument("--not-after", default="24h", metavar="DURATION",
                   help="how long after submission a device that has not started the run may still start it "
                        "(e.g. 90m, 6h, 2d; default 24h); signed with the run")
    s.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="after publishing, wait up to this long for the devices' answers in their status (accepted, "
                        "queued, declined or refused, with the reason) and print them; exit 1 when every device that "
                        "answered refused the run (default 10)")
    s.add_argument("--no-wait", action="store_true", help="return once the broker has the run (no answers)")
    s.add_argument("--json", action="store_true",
                   help="print what was submitted as one JSON document (run_id, federation, ..., follow, and the "
                        "answers, no_answer and waited_s of the wait)")
    s.set_defaults(func=cmd_submit)

    li = rs.add_parser("list", help="runs of the federation, in queue order")
    common(li)
    li.add_argument("--json", action="store_true", help="machine-readable output")
    li.set_defaults(func=cmd_list)

    sh = rs.add_parser("show", help="one run, with each node's state and round")
    common(sh)
    sh.add_argument("run", help="run id")
    sh.add_argument("--json", action="store_true", help="machine-readable output")
    sh.set_defaults(func=cmd_show)

    c = rs.add_parser("cancel", help="cancel a run for good (members stop within one round; a replayed "
                                     "submission of it is refused); exit 1 when every member already finished it")
    common(c)
    c.add_argument("run", help="run id")
    c.add_argument("--operator-dir", default=None,
                   help="folder with the operator's key and certificate (required, exit 2 without it, when the "
                        "federation's devices require signed runs)")
    c.set_defaults(func=cmd_cancel)

    e = rs.add_parser("enroll-operator", help="create an operator key and certificate (role operator)")
    e.add_argument("name", help="operator name (shown as the submitter of runs)")
    e.add_argument("--dir", required=True, help="folder holding the federation key (dflctl keys federation-init)")
    e.add_argument("--federation", required=True, help="federation name")
    e.add_argument("--out", required=True, help="folder to write operator_key.pem and operator_cert.json to")
    from dfl_agent.cli.cli_security import valid_days
    from dfl_agent.security.keys import DEFAULT_VALID_DAYS

    e.add_argument("--valid-days", type=valid_days, default=DEFAULT_VALID_DAYS, metavar="DAYS",
                   help=f"certificate lifetime in days (default {DEFAULT_VALID_DAYS:g}; 0: never expires)")
    e.set_defaults(func=cmd_enroll_operator)
