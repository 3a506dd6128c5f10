"""The lab's TLS material: a CA and, per site, a broker certificate for its lab address
(made with ``cryptography``; valid for a day, never leaves the lab's output folder)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def sign_certificate(subject: x509.Name, issuer_key: Any, issuer: x509.Name, key: Any, *, ca: bool = False,
                     san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    """An X.509 certificate for ``key``'s public key named ``subject``, signed by ``issuer_key``
    (``issuer``), valid from 5 minutes ago for one day; ``ca``: a CA certificate; ``san``: its
    subject alternative names (host names, IP addresses)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(obj: Any, path: Path) -> None:
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)


class LabCA:
    """A CA in ``folder`` (``ca.crt``) that signs broker certificates."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dfl-lab CA")])
        _write(sign_certificate(self._name, self._key, self._name, self._key, ca=True), self.cafile)

    @property
    def cafile(self) -> Path:
        return self.folder / "ca.crt"

    def server(self, name: str, address: str) -> tuple[Path, Path]:
        """A server certificate and key for ``address`` (an IP, in the SAN): their paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
        cert = sign_certificate(subject, self._key, self._name, key, ca=False,
                     san=[x509.IPAddress(ipaddress.ip_address(address))])
        crt, kf = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        _write(cert, crt)
        _write(key, kf)
        return crt, kf
