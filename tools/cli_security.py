"""``dflctl keys``: the federation key, device enrollment, key inspection.

``dflctl keys federation-init --dir D``
    creates ``D/federation_key.pem`` (Ed25519, mode 0600; keep it offline) and
    prints its public key for every node's ``security.federation_key``.
``dflctl keys enroll DEVICE --dir D --federation FED (--state-dir S | --public-key B64)``
    signs a device certificate for DEVICE's public key (taken from, or created in, its
    state directory S, or given as base64), writes it (``S/node_cert.json``, else
    ``--out`` or ``D/certs/DEVICE.json``), and creates the device's broker credentials:
    a random password added to ``D/mosquitto.passwd`` with ``mosquitto_passwd`` (hashed,
    mosquitto's own format; mode 0640, owner ``mosquitto`` when run as root where that user
    exists); without that tool the file gets ``DEVICE:PASSWORD`` lines in clear, to be
    hashed with ``mosquitto_passwd -U`` on the broker host.  The device's topics are
    granted in ``D/dfl.acl`` (a copy of the shipped ACL plus one ``user`` block per device).  The device's
    configuration snippet (``[mqtt]`` username/password, ``[security]``) goes to
    ``D/credentials/DEVICE.toml`` (mode 0600).
``dflctl keys enroll NAME --role bridge --dir D --federation FED``
    a broker user for another site's broker bridged to this one (no key, no
    certificate): its password, an ACL block granting ``dfl/FED/#`` both ways, and the
    bridge's login lines in ``D/credentials/NAME.conf`` (mode 0600).
``dflctl keys show [--state-dir S] [--dir D]``
    prints a node's public key, fingerprint and certificate (verified when the
    federation key is known), and the federation's public key.
``dflctl keys renew NODE --dir D (--state-dir S [--new-key] | --public-key B64 | nothing)``
    a new certificate for NODE, with the same key (the one in S, or the newest one
    ``D/issued.jsonl`` records) or a new one (``--new-key``: made in S; ``--public-key``: a
    key made on the device).  Peers verify the old and the new key until the old
    certificate expires or is revoked.
``dflctl keys revoke NODE --reason TEXT --dir D [--public-key B64] [connection options]``
    adds NODE (every key of it; with ``--public-key`` only that key) to the federation's
    revocation list (``D/revocations.json``, numbered, signed by the federation key),
    publishes it retained on ``dfl/FED/revocations`` with the operator's broker account
    (``--no-publish``: later, with ``keys revocations --publish``), and prints the broker
    credential lines to remove.
``dflctl keys revocations --dir D [--publish ...]``
    shows the federation's revocation list (and publishes it again).

Every certificate issued here (``enroll``, ``renew``) is recorded in ``D/issued.jsonl`` (one
JSON object a line: node, role, public key, fingerprint, issued, expires), so that ``renew``
and ``revoke`` know a node's keys.  Certificates expire after ``--valid-days`` (default
365; 0: never).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.security.keys import (
    CERT_FILE,
    DEFAULT_VALID_DAYS,
    FEDERATION_KEY_FILE,
    KEY_FILE,
    SecurityError,
    certificate_role,
    enroll_local,
    fingerprint,
    issue_certificate,
    load_certificate,
    load_or_create_key,
    load_private_key,
    parse_public_key,
    public_key_b64,
    save_certificate,
    save_private_key,
    utc_date,
    verify_certificate,
)
from dfl_agent.transport.wire import valid_id

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser

#: the federation folder's record of every certificate issued (one JSON object a line)
ISSUED_FILE = "issued.jsonl"
#: the federation folder's newest revocation list (signed; published retained by ``keys revoke``)
REVOCATIONS_FILE = "revocations.json"


def _fed_key(d: Path):
    path = d / FEDERATION_KEY_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no federation key (run 'dflctl keys federation-init --dir {d}')")
    return load_private_key(path)


def cmd_federation_init(a: argparse.Namespace) -> int:
    d = Path(a.dir)
    path = d / FEDERATION_KEY_FILE
    if path.exists() and not a.force:
        raise ValueError(f"{path} exists (use --force to replace it: every enrolled device must be re-enrolled)")
    if path.exists():
        path.unlink()
    d.mkdir(parents=True, exist_ok=True)
    key = load_or_create_key(d, str(path))
    pub = public_key_b64(key)
    (d / "federation_key.pub").write_text(pub + "\n")
    print(f"federation key: {path} (keep it secret and offline)")
    print(f"public key {pub} (fingerprint {fingerprint(pub)})")
    print("\nfor every node's configuration:\n[security]\nrequire_signatures = true\n"
          f'federation_key = "{pub}"')
    return 0


#: the broker's system user (Debian's mosquitto drops to it before reading password_file)
MOSQUITTO_USER = "mosquitto"
#: what every device may do with other nodes' topics (one ``user`` block per device)
DEVICE_ACL = ("topic write dfl/+/node/+/inbox", "topic read dfl/+/node/+/out", "topic read dfl/+/node/+/presence",
              "topic read dfl/+/node/+/status", "topic read dfl/+/node/+/model", "topic read dfl/+/run/+",
              "topic read dfl/+/run/+/cancel", "topic read dfl/+/revocations")
#: an operator account (``--role operator``): publishes run descriptors, their cancel
#: records and the revocation list (``dflctl keys revoke``), reads everything
OPERATOR_ACL = ("topic write dfl/+/run/+", "topic write dfl/+/run/+/cancel", "topic write dfl/+/revocations",
                "topic read dfl/#")
#: a bridge account (``--role bridge``): another site's broker forwarding the federation's
#: topics both ways (``topic dfl/FED/# both 1``); ``{fed}`` is the federation
BRIDGE_ACL = ("topic readwrite dfl/{fed}/#",)


def give_to_mosquitto(path: Path, mode: int = 0o640) -> str | None:
    """Make ``path`` readable by the broker: mode ``mode``, owner ``mosquitto:mosquitto``.

    Returns:
        None when done; else (not root, or no ``mosquitto`` user here) the exact command
        to run on the broker host, e.g. ``sudo chown mosquitto:mosquitto fed/mosquitto.passwd``.
    """
    import grp
    import pwd

    os.chmod(path, mode)
    try:
        uid, gid = pwd.getpwnam(MOSQUITTO_USER).pw_uid, grp.getgrnam(MOSQUITTO_USER).gr_gid
    except KeyError:
        uid = gid = -1
    if uid >= 0 and os.geteuid() == 0:
        os.chown(path, uid, gid)
        return None
    return f"sudo chown {MOSQUITTO_USER}:{MOSQUITTO_USER} {path}"


def add_mosquitto_password(passwd_file: Path, user: str, password: str) -> str:
    """Add ``user`` to a mosquitto password file, mode 0640 (owner ``mosquitto`` when run as
    root where that user exists: see :func:`give_to_mosquitto`).

    Returns:
        ``"hashed"`` (``mosquitto_passwd`` was found) or ``"plain"`` (``user:password`` in
        clear, to hash with ``mosquitto_passwd -U`` on the broker host).

    Raises:
        subprocess.CalledProcessError: ``mosquitto_passwd`` failed.
    """
    tool = shutil.which("mosquitto_passwd")
    passwd_file.parent.mkdir(parents=True, exist_ok=True)
    if tool:
        cmd = [tool, "-b"] + ([] if passwd_file.exists() else ["-c"]) + [str(passwd_file), user, password]
        subprocess.run(cmd, check=True, capture_output=True)
        how = "hashed"
    else:
        fd = os.open(passwd_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        with os.fdopen(fd, "a") as f:
            f.write(f"{user}:{password}\n")
        how = "plain"
    give_to_mosquitto(passwd_file)
    return how


def add_acl_user(acl_file: Path, user: str, role: str = "device", federation: str = "") -> bool:
    """Grant ``user`` its topics in a mosquitto ACL file: a ``user`` block appended to
    ``acl_file`` (created from the shipped ``dfl.acl`` when missing, mode 0644).

    Args:
        acl_file: the federation's ACL (``FEDERATION_DIR/dfl.acl``).
        user: the broker user (the node id).
        role: ``device`` (:data:`DEVICE_ACL`), ``operator`` (:data:`OPERATOR_ACL`) or
            ``bridge`` (:data:`BRIDGE_ACL`: every topic of ``federation``, both ways).
        federation: the federation a bridge account forwards (required for ``bridge``).

    Returns:
        True when the block was added, False when ``user`` already had one.
    """
    from dfl_agent.resources import resource_dir

    if not acl_file.exists():
        acl_file.parent.mkdir(parents=True, exist_ok=True)
        acl_file.write_text((resource_dir("mosquitto") / "dfl.acl").read_text(encoding="utf-8"), encoding="utf-8")
        os.chmod(acl_file, 0o644)
    text = acl_file.read_text(encoding="utf-8")
    if any(line.split() == ["user", user] for line in text.splitlines()):
        return False
    if role == "bridge":
        if not valid_id(federation):
            raise ValueError("a bridge account needs its federation")
        lines = tuple(line.format(fed=federation) for line in BRIDGE_ACL)
    else:
        lines = OPERATOR_ACL if role == "operator" else DEVICE_ACL
    with acl_file.open("a", encoding="utf-8") as f:
        f.write(("" if text.endswith("\n") else "\n") + f"\nuser {user}\n" + "".join(f"{ln}\n" for ln in lines))
    return True


def valid_days(text: str) -> float | None:
    """``--valid-days``: a certificate's lifetime in days (> 0), or ``0``: it never expires."""
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if days < 0 or days != days:
        raise argparse.ArgumentTypeError("must be >= 0 days (0: the certificate never expires)")
    return None if days == 0 else days


def record_issued(d: Path, cert: dict[str, Any], where: Path | None) -> None:
    """Append ``cert`` (its node, role, key, fingerprint, validity and file) to ``D/issued.jsonl``."""
    import json

    line = {"node_id": cert["node_id"], "role": certificate_role(cert), "public_key": cert["public_key"],
            "fingerprint": fingerprint(cert["public_key"]), "issued": cert["issued"], "expires": cert["expires"],
            "file": str(where) if where is not None else None}
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / ISSUED_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def issued_to(d: Path, node: str) -> list[dict[str, Any]]:
    """The certificates ``D/issued.jsonl`` records for ``node``, oldest first (unreadable lines skipped)."""
    import json

    out = []
    try:
        lines = (d / ISSUED_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("node_id") == node and isinstance(doc.get("public_key"), str):
            out.append(doc)
    return out


def _refuse_revoked(d: Path, node: str, federation: str, fed_key: Any) -> None:
    """Raise ValueError when the federation folder's revocation list revokes ``node`` as a whole."""
    rev = _revocation_list(d, fed_key, federation)
    hit = rev.revoked(node) if rev is not None else None
    if hit is not None:
        raise ValueError(f"node {node} is revoked (revocation list {rev.number}: {hit.reason}); "
                         "enroll the replacement device under a new node id")


def cmd_enroll(a: argparse.Namespace) -> int:
    if not valid_id(a.device) or not valid_id(a.federation):
        raise ValueError("DEVICE and --federation must match [A-Za-z0-9_.-]{1,64}")
    d = Path(a.dir)
    fed_key = _fed_key(d)
    if a.role == "bridge":
        return _enroll_bridge(a, d)
    _refuse_revoked(d, a.device, a.federation, fed_key)
    if a.state_dir:
        cert = enroll_local(fed_key, a.federation, a.device, a.state_dir, valid_days=a.valid_days, role=a.role)
        where = Path(a.state_dir) / CERT_FILE
    elif a.public_key:
        cert = issue_certificate(fed_key, a.federation, a.device, a.public_key.strip(), valid_days=a.valid_days,
                                 role=a.role)
        where = Path(a.out) if a.out else d / "certs" / f"{a.device}.json"
        where.parent.mkdir(parents=True, exist_ok=True)
        save_certificate(cert, where)
    else:
        raise ValueError("give --state-dir (the device's state directory) or --public-key")
    record_issued(d, cert, where)
    print(f"{a.role} certificate for {a.device} ({fingerprint(cert['public_key'])}): {where}, "
          f"{_validity(cert)}")
    if not a.no_credentials:
        password = secrets.token_urlsafe(18)
        passwd = d / "mosquitto.passwd"
        how = add_mosquitto_password(passwd, a.device, password)
        add_acl_user(d / "dfl.acl", a.device, a.role)
        creds = d / "credentials" / f"{a.device}.toml"
        creds.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'node_id = "{a.device}"\nfederation = "{a.federation}"\n\n[mqtt]\nusername = "{a.device}"\n'
                    f'password = "{password}"\n\n[security]\nrequire_signatures = true\n'
                    f'federation_key = "{public_key_b64(fed_key)}"\n')
        print(f"broker user {a.device}: {passwd} ({how}), its topics in {d / 'dfl.acl'}; "
              f"device configuration snippet: {creds}")
        print(f"on the broker host: sudo install -o {MOSQUITTO_USER} -g {MOSQUITTO_USER} -m 0640 {passwd} "
              f"/etc/mosquitto/dfl.passwd && sudo install -m 0644 {d / 'dfl.acl'} /etc/mosquitto/dfl.acl "
              "&& sudo systemctl reload mosquitto")
    return 0


def _enroll_bridge(a: argparse.Namespace, d: Path) -> int:
    """``enroll NAME --role bridge``: a broker user for another site's broker (no node key
    and no certificate: a bridge signs nothing, it forwards signed frames), its ACL block,
    and the bridge's login lines for that broker's configuration (``D/credentials/NAME.conf``,
    mode 0600)."""
    if a.no_credentials:
        raise ValueError("a bridge is only broker credentials: --no-credentials leaves nothing to do")
    password = secrets.token_urlsafe(18)
    passwd = d / "mosquitto.passwd"
    how = add_mosquitto_password(passwd, a.device, password)
    add_acl_user(d / "dfl.acl", a.device, "bridge", a.federation)
    snippet = d / "credentials" / f"{a.device}.conf"
    snippet.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(snippet, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"# the bridge {a.device} to the hub of federation {a.federation}: add these lines below the\n"
                f"# 'connection' and 'address' lines of the site broker's bridge (docs: multi-site)\n"
                f"remote_username {a.device}\nremote_password {password}\ntopic dfl/{a.federation}/# both 1\n")
    print(f"bridge user {a.device}: {passwd} ({how}), every topic of dfl/{a.federation}/ both ways in "
          f"{d / 'dfl.acl'}; bridge login lines for the site broker: {snippet}")
    print(f"on the hub's broker host: sudo install -o {MOSQUITTO_USER} -g {MOSQUITTO_USER} -m 0640 {passwd} "
          f"/etc/mosquitto/dfl.passwd && sudo install -m 0644 {d / 'dfl.acl'} /etc/mosquitto/dfl.acl "
          "&& sudo systemctl reload mosquitto")
    return 0


def _validity(cert: dict[str, Any]) -> str:
    exp = cert.get("expires")
    return "never expires" if exp is None else f"valid until {utc_date(exp)}"


def cmd_renew(a: argparse.Namespace) -> int:
    """``keys renew NODE``: a new certificate for the same node id, with its key (the state
    directory's, ``--public-key``'s, or the newest one ``D/issued.jsonl`` records) or a new key
    (``--new-key`` in ``--state-dir``); the node's role and federation are those of its last
    certificate unless given."""
    if not valid_id(a.device):
        raise ValueError("NODE must match [A-Za-z0-9_.-]{1,64}")
    d = Path(a.dir)
    fed_key = _fed_key(d)
    known = issued_to(d, a.device)
    old: dict[str, Any] | None = None
    if a.state_dir and (Path(a.state_dir) / CERT_FILE).exists():
        old = load_certificate(Path(a.state_dir) / CERT_FILE)
        if old.get("node_id") != a.device:
            raise ValueError(f"{Path(a.state_dir) / CERT_FILE} is the certificate of node {old.get('node_id')!r}, "
                             f"not {a.device!r}")
    federation = a.federation or (old or {}).get("fed")
    if not isinstance(federation, str) or not valid_id(federation):
        raise ValueError("give --federation (no earlier certificate of this node names it)")
    role = a.role or (certificate_role(old) if old is not None else known[-1]["role"] if known else "device")
    _refuse_revoked(d, a.device, federation, fed_key)
    if a.new_key and not a.state_dir:
        raise ValueError("--new-key makes the key in the device's --state-dir (or give the device's new "
                         "--public-key)")
    old_key = old.get("public_key") if old is not None else known[-1]["public_key"] if known else None
    if a.state_dir:
        state = Path(a.state_dir)
        if a.new_key:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            if (state / KEY_FILE).exists():  # kept beside: the old certificate still names it
                save_private_key(load_private_key(state / KEY_FILE), state / (KEY_FILE + ".old"))
            key = Ed25519PrivateKey.generate()
            save_private_key(key, state / KEY_FILE)
        else:
            key = load_or_create_key(state)
        public = public_key_b64(key)
        where = state / CERT_FILE
    else:
        public = a.public_key.strip() if a.public_key else old_key
        if public is None:
            raise ValueError(f"no key of node {a.device} is recorded in {d / ISSUED_FILE}: give --state-dir or "
                             "--public-key")
        where = Path(a.out) if a.out else d / "certs" / f"{a.device}.json"
        where.parent.mkdir(parents=True, exist_ok=True)
    cert = issue_certificate(fed_key, federation, a.device, public, valid_days=a.valid_days, role=role)
    save_certificate(cert, where)
    record_issued(d, cert, where)
    same = old_key == public
    print(f"renewed the {role} certificate of {a.device} ({'same' if same else 'new'} key "
          f"{fingerprint(public)}): {where}, {_validity(cert)}")
    if not a.state_dir:
        print(f"copy it to the device as its state directory's {CERT_FILE} (or security.certificate)")
    print("restart the device's agent to use it" + ("" if same or old_key is None else
          f"; peers verify both keys until the old certificate expires or is revoked "
          f"(dflctl keys revoke {a.device} --public-key {old_key} --reason renewed)"))
    return 0


def _revocation_list(d: Path, fed_key: Any, federation: str) -> Any:
    """The federation folder's revocation list (verified), or None.

    Raises:
        ValueError: it exists but does not verify or is for another federation (names the file).
    """
    from dfl_agent.security.revocation import load_revocation_file

    try:
        return load_revocation_file(d / REVOCATIONS_FILE, fed_key.public_key(), federation)
    except SecurityError as exc:
        raise ValueError(str(exc)) from None


def _federation_of(a: argparse.Namespace) -> str:
    from dfl_agent.cli import fleet

    if not a.federation and not a.config:
        raise ValueError("give --federation (or --config, a node configuration of the federation)")
    fed = fleet.target(a).federation
    if not valid_id(fed):
        raise ValueError("--federation must match [A-Za-z0-9_.-]{1,64}")
    return str(fed)


def _publish_revocations(a: argparse.Namespace, rev: Any) -> int:
    """Publish ``rev`` retained on ``dfl/FED/revocations`` (QoS 1) with the fleet options' account.
    Returns 0, or 1 when the broker refused it (its ACL; one line on stderr saying whom to use).

    Raises:
        ConnectionError: the broker cannot be used (dflctl exits 3).
    """
    import sys

    from dfl_agent.cli import fleet
    from dfl_agent.cli.fleet import publish_retained
    from dfl_agent.security.revocation import revocation_topic

    t = fleet.target(a)
    topic = revocation_topic(rev.federation)
    try:
        publish_retained(t, topic, rev.payload(), timeout=a.timeout)
    except fleet.PublishRefused:
        who = f"user {t.username!r}" if t.username else "an anonymous client"
        print(f"dflctl: broker {t.broker} refused the revocation list on {topic}: its ACL does not let {who} write "
              "it; use the operator's broker account (-u operator --password-file FILE, or the operator's --config)",
              file=sys.stderr)
        return 1
    print(f"published revocation list {rev.number} retained on {topic} ({t.broker})")
    return 0


def _credential_lines(d: Path, node: str) -> tuple[list[str], list[str]]:
    """The lines of ``D/mosquitto.passwd`` and the ``user NODE`` block of ``D/dfl.acl`` that give
    ``node`` its broker account."""
    pw: list[str] = []
    acl: list[str] = []
    try:
        pw = [ln for ln in (d / "mosquitto.passwd").read_text(encoding="utf-8").splitlines()
              if ln.split(":", 1)[0] == node]
    except OSError:
        pass
    try:
        lines = (d / "dfl.acl").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    inside = False
    for ln in lines:
        words = ln.split()
        if words[:1] == ["user"]:
            inside = words == ["user", node]
        elif not ln.strip():
            inside = False
        if inside:
            acl.append(ln)
    return pw, acl


def blocks_without_revocations(acl_file: Path) -> list[str]:
    """The device and operator users of ``acl_file`` whose block lacks its revocation-list line
    (``topic read dfl/+/revocations``, ``topic write`` for operators): accounts enrolled before
    revocation lists existed, which never hear of a revocation until the line is added."""
    try:
        lines = acl_file.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    blocks: dict[str, list[str]] = {}
    user = None
    for ln in lines:
        words = ln.split()
        if words[:1] == ["user"] and len(words) == 2:
            user = words[1]
            blocks[user] = []
        elif user is not None and words[:1] == ["topic"]:
            blocks[user].append(" ".join(words))
    out = []
    for u, b in blocks.items():
        if "topic write dfl/+/run/+" in b:  # an operator publishes the list
            if "topic write dfl/+/revocations" not in b and "topic readwrite dfl/+/revocations" not in b:
                out.append(u)
        elif any(t.startswith("topic read dfl/+/node/") for t in b):  # a device reads it
            if not {"topic read dfl/+/revocations", "topic read dfl/#"} & set(b):
                out.append(u)
    return out


def cmd_revoke(a: argparse.Namespace) -> int:
    """``keys revoke NODE --reason TEXT``: the next revocation list, signed, saved, published."""
    from dfl_agent.security.revocation import RevocationRejected, Revoked, sign_revocations, verify_revocations

    if not valid_id(a.device):
        raise ValueError("NODE must match [A-Za-z0-9_.-]{1,64}")
    reason = " ".join(a.reason.split())
    if not reason or len(reason) > 200:
        raise ValueError("--reason: say why in 1 to 200 characters (e.g. 'stolen', 'decommissioned')")
    if a.public_key:
        parse_public_key(a.public_key)
    d = Path(a.dir)
    fed_key = _fed_key(d)
    federation = _federation_of(a)
    base = _revocation_list(d, fed_key, federation)
    if not a.no_publish:  # the broker may hold a newer list (made from a copy of this folder)
        from dfl_agent.cli import fleet
        from dfl_agent.cli.fleet import fetch_retained
        from dfl_agent.security.revocation import revocation_topic

        held = fetch_retained(fleet.target(a), revocation_topic(federation), timeout=a.timeout)
        if held:
            try:
                remote = verify_revocations(held, fed_key.public_key(), federation)
            except RevocationRejected as exc:
                print(f"warning: the broker's retained revocation list is not usable ({exc}); replacing it")
            else:
                if base is None or remote.number > base.number:
                    base = remote
    entries = list(base.entries) if base is not None else []
    key = a.public_key.strip() if a.public_key else None
    done = next((e for e in entries if e.node_id == a.device and e.public_key in (None, key)), None)
    if done is not None and base is not None:
        print(f"{a.device}{'' if key is None else ' key ' + fingerprint(key)} is revoked already "
              f"(revocation list {base.number}: {done.reason})")
        rev = base
    else:
        entries.append(Revoked(a.device, key, reason, time.time()))
        rev = sign_revocations(fed_key, federation, (base.number if base is not None else 0) + 1, entries)
        from dfl_agent.fsutil import atomic_write

        atomic_write(d / REVOCATIONS_FILE, rev.payload(), 0o644)
        keys = issued_to(d, a.device)
        what = (f"key {fingerprint(key)}" if key is not None else
                f"every key ({', '.join(sorted({k['fingerprint'] for k in keys})) or 'none recorded here'})")
        print(f"revoked {a.device}, {what}: revocation list {rev.number} in {d / REVOCATIONS_FILE}")
    stale = blocks_without_revocations(d / "dfl.acl")
    if stale:
        print(f"warning: in {d / 'dfl.acl'} the blocks of {', '.join(stale)} lack 'topic read dfl/+/revocations' "
              "(enrolled before revocation lists existed): add it to each, install the ACL on the broker and reload "
              "it, or those nodes never hear of a revocation")
    rc = 0
    if not a.no_publish:
        rc = _publish_revocations(a, rev)
    if a.no_publish or rc:
        print(f"not published: run 'dflctl keys revocations --dir {d} --publish' with the operator's broker account")
    if key is None:
        pw, acl = _credential_lines(d, a.device)
        print(f"\nremove {a.device}'s broker account, so that the device cannot connect at all:")
        print(f"  password file {d / 'mosquitto.passwd'}: " + (", ".join(f"the line '{ln.split(':', 1)[0]}:...'"
                                                                      for ln in pw) or "no line for it"))
        if acl:
            print(f"  ACL {d / 'dfl.acl'}: the block\n" + "\n".join(f"    {ln}" for ln in acl))
        else:
            print(f"  ACL {d / 'dfl.acl'}: no block for it")
        print(f"  on the broker host: sudo mosquitto_passwd -D /etc/mosquitto/dfl.passwd {a.device}, remove the block "
              "from /etc/mosquitto/dfl.acl, sudo systemctl reload mosquitto")
    return rc


def cmd_revocations(a: argparse.Namespace) -> int:
    """``keys revocations``: show the federation folder's revocation list (``--publish``: publish it again)."""
    d = Path(a.dir)
    fed_key = _fed_key(d)
    federation = _federation_of(a)
    rev = _revocation_list(d, fed_key, federation)
    if rev is None:
        print(f"no revocation list in {d} (nothing revoked)")
        return 0
    if a.json:
        from dfl_agent.cli.output import json_doc

        print(json_doc({"number": rev.number, "issued": rev.issued, "federation": rev.federation,
                        "revoked": [e.to_dict() for e in rev.entries]}))
    else:
        print(f"revocation list {rev.number} of federation {federation}, signed {utc_date(rev.issued)}:")
        for e in rev.entries:
            what = "every key" if e.public_key is None else f"key {fingerprint(e.public_key)}"
            print(f"  {e.node_id}: {what}, {utc_date(e.time)}: {e.reason}")
    return _publish_revocations(a, rev) if a.publish else 0


def cmd_show(a: argparse.Namespace) -> int:
    """``keys show``: the federation key, the node key and the node certificate (with ``--json``
    one document: ``federation_key``, ``node_key``, ``certificate``; absent parts are null)."""
    doc: dict[str, Any] = {"federation_key": None, "node_key": None, "certificate": None}
    lines: list[str] = []
    fed_pub = None
    if a.dir and (Path(a.dir) / FEDERATION_KEY_FILE).exists():
        fed_pub = public_key_b64(_fed_key(Path(a.dir)))
        doc["federation_key"] = {"public_key": fed_pub, "fingerprint": fingerprint(fed_pub)}
        lines.append(f"federation public key {fed_pub} (fingerprint {fingerprint(fed_pub)})")
    if a.state_dir:
        s = Path(a.state_dir)
        if not (s / KEY_FILE).exists():
            lines.append(f"{s / KEY_FILE}: no node key yet (created on the agent's first start)")
        else:
            pub = public_key_b64(load_private_key(s / KEY_FILE))
            doc["node_key"] = {"public_key": pub, "fingerprint": fingerprint(pub)}
            lines.append(f"node public key {pub} (fingerprint {fingerprint(pub)})")
        if (s / CERT_FILE).exists():
            cert: dict[str, Any] = load_certificate(s / CERT_FILE)
            state = "not verified (no --dir with the federation key)"
            if fed_pub:
                try:
                    verify_certificate(cert, parse_public_key(fed_pub), str(cert.get("fed")))
                    state = f"valid ({_validity(cert)})"
                except SecurityError as exc:
                    state = f"INVALID: {exc}"
            doc["certificate"] = {"node_id": cert.get("node_id"), "federation": cert.get("fed"), "state": state}
            lines.append(f"certificate: node {cert.get('node_id')} federation {cert.get('fed')}: {state}")
    if getattr(a, "json", False):
        from dfl_agent.cli.output import json_doc

        print(json_doc(doc))
    else:
        for line in lines:
            print(line)
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl keys ...`` to the ``dflctl`` sub-parsers."""
    k = sub.add_parser("keys", help="federation key, device enrollment, key inspection")
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    fi = ks.add_parser("federation-init", help="create the federation signing key")
    fi.add_argument("--dir", default="federation", help="folder for the federation key (default ./federation)")
    fi.add_argument("--force", action="store_true", help="replace an existing key")
    fi.set_defaults(func=cmd_federation_init)
    en = ks.add_parser("enroll", help="sign a device certificate and create its broker credentials")
    en.add_argument("device", help="the device's node id (also its broker user name; for a bridge its user name)")
    en.add_argument("--federation", required=True, help="federation name the certificate is for")
    en.add_argument("--dir", default="federation", help="folder of the federation key")
    en.add_argument("--state-dir", help="the device's state directory (key read or created there)")
    en.add_argument("--public-key", help="the device's public key (base64), instead of --state-dir")
    en.add_argument("--out", help="certificate file (with --public-key)")
    en.add_argument("--valid-days", type=valid_days, default=DEFAULT_VALID_DAYS, metavar="DAYS",
                    help=f"certificate lifetime in days (default {DEFAULT_VALID_DAYS:g}; 0: never expires; renew "
                         "before it ends with 'dflctl keys renew')")
    en.add_argument("--role", choices=("device", "operator", "bridge"), default="device",
                    help="what the certificate allows: a training device, or an operator who submits runs; "
                         "bridge: only a broker user for another site's broker (no certificate)")
    en.add_argument("--no-credentials", action="store_true", help="do not create broker credentials")
    en.set_defaults(func=cmd_enroll)
    sh = ks.add_parser("show", help="show a node's key and certificate, and the federation key")
    sh.add_argument("--state-dir", help="the node's state directory holding its key")
    sh.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    sh.add_argument("--dir", help="folder of the federation key")
    sh.set_defaults(func=cmd_show)

    from dfl_agent.cli.fleet import add_options as fleet_options

    rn = ks.add_parser("renew", help="a new certificate for a node: the same key, or a new one (--new-key)")
    rn.add_argument("device", metavar="NODE", help="the node id")
    rn.add_argument("--dir", default="federation", help="folder of the federation key")
    rn.add_argument("--federation", default=None, help="federation name (default: its last certificate's)")
    rn.add_argument("--state-dir", help="the device's state directory (its key, and its certificate is replaced)")
    rn.add_argument("--new-key", action="store_true",
                    help="make a new key in --state-dir (the old one is kept as node_key.pem.old); peers verify "
                         "both keys until the old certificate expires or is revoked")
    rn.add_argument("--public-key", help="the device's key (base64), a new one made on the device or the same; "
                                         "default: the newest one recorded in the federation folder")
    rn.add_argument("--out", help="certificate file (without --state-dir; default DIR/certs/NODE.json)")
    rn.add_argument("--valid-days", type=valid_days, default=DEFAULT_VALID_DAYS, metavar="DAYS",
                    help=f"certificate lifetime in days (default {DEFAULT_VALID_DAYS:g}; 0: never expires)")
    rn.add_argument("--role", choices=("device", "operator"), default=None,
                    help="the certificate's role (default: its last certificate's)")
    rn.set_defaults(func=cmd_renew)

    rv = ks.add_parser("revoke", help="revoke a node (or one key of it): a signed revocation list, published")
    rv.add_argument("device", metavar="NODE", help="the node id to revoke (every key of it, now and later)")
    rv.add_argument("--reason", required=True, help="why, kept in the list (e.g. 'stolen', 'decommissioned')")
    rv.add_argument("--public-key", default=None, metavar="B64",
                    help="revoke only this key of the node (e.g. its old key after 'keys renew --new-key')")
    rv.add_argument("--dir", default="federation", help="folder of the federation key (revocations.json goes there)")
    rv.add_argument("--no-publish", action="store_true",
                    help="only write the list (publish it later with 'keys revocations --publish')")
    fleet_options(rv)
    rv.set_defaults(func=cmd_revoke)

    rl = ks.add_parser("revocations", help="show the federation's revocation list, or publish it again")
    rl.add_argument("--dir", default="federation", help="folder of the federation key")
    rl.add_argument("--publish", action="store_true", help="publish it (retained) with the operator's account")
    rl.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    fleet_options(rl)
    rl.set_defaults(func=cmd_revocations)
