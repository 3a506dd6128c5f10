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
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from dfl_agent.security.keys import (
    CERT_FILE,
    FEDERATION_KEY_FILE,
    KEY_FILE,
    SecurityError,
    enroll_local,
    fingerprint,
    issue_certificate,
    load_certificate,
    load_or_create_key,
    load_private_key,
    parse_public_key,
    public_key_b64,
    save_certificate,
    verify_certificate,
)
from dfl_agent.transport.wire import valid_id


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
              "topic read dfl/+/run/+/cancel")
#: an operator account (``--role operator``): publishes run descriptors and their cancel
#: records, reads everything
OPERATOR_ACL = ("topic write dfl/+/run/+", "topic write dfl/+/run/+/cancel", "topic read dfl/#")
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


def cmd_enroll(a: argparse.Namespace) -> int:
    if not valid_id(a.device) or not valid_id(a.federation):
        raise ValueError("DEVICE and --federation must match [A-Za-z0-9_.-]{1,64}")
    d = Path(a.dir)
    fed_key = _fed_key(d)
    if a.role == "bridge":
        return _enroll_bridge(a, d)
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
    print(f"{a.role} certificate for {a.device} ({fingerprint(cert['public_key'])}): {where}")
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
                    state = "valid"
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


def register(sub: Any) -> None:
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
    en.add_argument("--valid-days", type=float, default=None, help="certificate lifetime (default: no expiry)")
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
