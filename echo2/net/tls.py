"""TLS pinned to the run: the per-run CA, the certificates it issues, and how a worker joins.

Off loopback every server of the run (coordinator, the learner's relay origin, each worker's snapshot and relay
servers) speaks TLS with a certificate from the run's own CA, and every client verifies against that CA alone,
pinned by its sha256 fingerprint given with the join command (as ``kubeadm join
--discovery-token-ca-cert-hash`` does). Certificates name a role (LEARNER_NAME, PEER_NAME), not an address, and a
worker's names its credential too (``credential_peer_name``). Plain
HTTP remains on loopback and by explicit opt-out.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import ipaddress
import json
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

from echo2.net.http import Client, RemoteError

LEARNER_NAME = "learner.echo2.invalid"  # the coordinator and the learner's relay origin (also a PEER)
PEER_NAME = "peer.echo2.invalid"  # every relay source and snapshot receiver


def credential_peer_name(credential: str | None) -> str:
    """The second name a worker's certificate carries: its credential's (None: the run secret's, the learner's own
    workers), hashed into a DNS label. The learner sends a worker's orders only to a server whose certificate names
    that worker's credential, so a worker of another credential (a revoked one still holding an unexpired
    certificate, say) that takes over its address gets neither the orders nor the relay key in them."""
    who = "run-secret" if credential is None else f"worker:{credential}"
    return f"{hashlib.sha256(who.encode()).hexdigest()[:32]}.credential.echo2.invalid"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fingerprint(ca_pem: bytes) -> str:
    """``sha256:<hex>`` of the CA's public key (DER SubjectPublicKeyInfo), as kubeadm's CA cert hash."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = x509.load_pem_x509_certificate(ca_pem).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


@dataclass
class Trust:
    """One process's TLS material: the pinned run CA, a client context verifying against it alone, and the
    context its own servers present (None: it serves nothing over TLS)."""

    ca_pem: bytes
    ca_file: str  # the CA on disk, for requests' ``verify``
    server: ssl.SSLContext | None

    @property
    def client(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.ca_pem.decode())
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def connect(self, sock: socket.socket, server_name: str = PEER_NAME) -> ssl.SSLSocket:
        return self.client.wrap_socket(sock, server_hostname=server_name)


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_certificate(ctx, cert_pem, key_pem)
    return ctx


def load_certificate(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """Set (or replace: a renewed certificate) what a server's TLS context presents. ssl loads keys from files only:
    0600, removed at once."""
    fd, path = tempfile.mkstemp(suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + key_pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)


PEER_CERT_LIFETIME_S = 6 * 3600
"""What a certificate ``RunCA.issue`` makes for a worker's servers lasts: a revoked worker, which gets no new one, is
refused by every TLS client of the run (its peers, the learner) within this; a worker agent renews its own every
third of it. The CA and the learner's own certificate last RUN_CERT_LIFETIME_S (nobody revokes the learner)."""

RUN_CERT_LIFETIME_S = 365 * 86400


class RunCA:
    """The learner's per-run certificate authority, kept in ``directory`` (made on first use, reused by a restarted
    coordinator or a resumed learner, so that workers' pinned fingerprint stays valid for the whole run)."""

    def __init__(self, directory: str):
        from cryptography.hazmat.primitives import serialization

        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.dir, ca_file, key_file = directory, os.path.join(directory, "ca.pem"), os.path.join(directory, "ca.key")
        if not os.path.exists(ca_file):
            key = _new_key()
            _write_private(key_file, _key_pem(key))
            with open(ca_file, "wb") as f:
                f.write(_certificate("echo2 run CA", key.public_key(), key, None, ca=True))
        with open(ca_file, "rb") as f:
            self.ca_pem = f.read()
        with open(key_file, "rb") as f:
            self._key = serialization.load_pem_private_key(f.read(), password=None)
        self.ca_file, self.fingerprint = ca_file, fingerprint(self.ca_pem)

    def issue(self, names: list[str], lifetime_s: float = PEER_CERT_LIFETIME_S) -> tuple[bytes, bytes]:
        """A fresh key and a certificate for ``names`` signed by the run CA, valid ``lifetime_s``: (cert PEM, key
        PEM)."""
        key = _new_key()
        cert = _certificate(names[0], key.public_key(), self._key, names, ca=False, lifetime_s=lifetime_s)
        return cert, _key_pem(key)

    def trust(self) -> Trust:
        """The learner's own: its servers present a certificate for LEARNER_NAME and PEER_NAME."""
        own = self.issue([LEARNER_NAME, PEER_NAME], lifetime_s=RUN_CERT_LIFETIME_S)
        return Trust(self.ca_pem, self.ca_file, server_context(*own))


def fetch_ca(url: str, pinned: str, timeout_s: float = 30.0) -> bytes:
    """The run CA from the coordinator at ``url``, over a first connection that verifies nothing; accepted only
    if its fingerprint is ``pinned`` (what the join command carries), so a man in the middle is caught here."""
    parts = urlsplit(url)
    unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout_s, context=unverified)
    try:
        conn.request("GET", "/ca")
        reply = conn.getresponse()
        body = reply.read()
    finally:
        conn.close()
    if reply.status != 200:
        raise RemoteError(reply.status, body[:500].decode(errors="replace"))
    ca_pem = json.loads(body)["ca"].encode()
    got = fingerprint(ca_pem)
    if not hmac.compare_digest(got, pinned.strip()):
        raise ssl.SSLError(f"the coordinator's CA has fingerprint {got}, not the pinned {pinned}: "
                           "wrong --ca-hash, or someone is in the middle")
    return ca_pem


def join(url: str, token: str, pinned: str, directory: str) -> Trust:
    """A worker's TLS material: the pinned CA (written to ``directory``) and a certificate for its own servers,
    issued by the coordinator over the now verified connection."""
    ca_pem = fetch_ca(url, pinned)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_file = os.path.join(directory, "ca.pem")
    with open(ca_file, "wb") as f:
        f.write(ca_pem)
    client = Client(url, token, ca_file=ca_file, server_name=LEARNER_NAME)
    try:
        issued = client.post("/certificate", {})
    finally:
        client.close()
    return Trust(ca_pem, ca_file, server_context(issued["cert"].encode(), issued["key"].encode()))


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _certificate(common_name: str, public_key, signing_key, names: list[str] | None, ca: bool,
                 lifetime_s: float = RUN_CERT_LIFETIME_S) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "echo2 run CA")])
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(seconds=lifetime_s))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    else:
        builder = (builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    # key identifiers: strict verifiers (Python >= 3.13's default flags) require them
    builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()),
                                    critical=False)
    cert = builder.sign(signing_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM)
