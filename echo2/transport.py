"""The shared transport of the rollout and broadcast planes: HTTP + JSON with token auth, and TLS pinned to the run.

Every request carries a credential (``Authorization: Bearer ...``), compared in constant time. Bodies are
JSON (never pickle) except snapshot uploads, which are raw bytes whose authenticity is checked by the receiver.
A bad request gets a 4xx with ``{"error": ...}``, a log line, and a counter; the server goes on.

TLS: off loopback every server of the run (coordinator, the learner's
relay origin, each worker's snapshot and relay servers) speaks TLS with a certificate from the run's own CA, and
every client verifies against that CA alone, pinned by its sha256 fingerprint given with the join command (as
``kubeadm join --discovery-token-ca-cert-hash`` does). Plain HTTP remains on loopback and by explicit opt-out.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import os
import re
import socket
import ssl
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import requests

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 << 20
WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(host: str) -> str:
    """The name others reach a server at: this machine's name for a wildcard bind, else the host as given."""
    return socket.getfqdn() if host in WILDCARDS else host


class BadRequest(Exception):
    """Raised by a route: the sender gets HTTP 400 with this message."""

    status = 400


class Unauthorized(BadRequest):
    status = 401


class Revoked(Unauthorized):
    """A worker credential revoked during the run (counted apart from wrong credentials)."""

    status = 403


# ---------------------------------------------------------------------- credentials

WORKER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def worker_credential(run_secret: str, name: str) -> str:
    """Worker ``name``'s own credential, ``name:HMAC-SHA256(run secret, name)``: the learner recognises it without
    a table, and revoking one name leaves every other worker's credential valid."""
    if not WORKER_NAME.fullmatch(name):
        raise ValueError(f"worker name {name!r}: 1-64 of A-Z a-z 0-9 _ . -")
    mac = hmac.new(run_secret.encode(), b"echo2-worker:" + name.encode(), hashlib.sha256).hexdigest()
    return f"{name}:{mac}"


def credential_name(run_secret: str, credential: str) -> str | None:
    """The worker name a valid worker credential carries; None if it is not one."""
    name, sep, _ = credential.partition(":")
    if not sep or not WORKER_NAME.fullmatch(name):
        return None
    return name if hmac.compare_digest(credential.encode(), worker_credential(run_secret, name).encode()) else None


def relay_key(run_secret: str) -> str:
    """The shared key of the broadcast plane (relay requests, the snapshot routes), derived from the run secret so
    that workers, who receive it when they join, never hold the run secret itself. Manifests are not signed with
    it (every worker holds it) but with the learner's own key (broadcast/manifest.py)."""
    return hmac.new(run_secret.encode(), b"echo2-relay", hashlib.sha256).hexdigest()


Route = Callable[[dict[str, Any] | bytes, dict[str, str]], Any]


class JsonServer:
    """``routes`` maps ``"POST /path"`` to ``fn(body, headers) -> jsonable``; ``raw`` routes get bytes."""

    def __init__(self, host: str, port: int, token: str, routes: dict[str, Route], raw: frozenset[str] = frozenset(),
                 max_bytes: int = MAX_JSON_BYTES, name: str = "server", tls: ssl.SSLContext | None = None,
                 public: frozenset[str] = frozenset(), authorize: Callable[[str, str], None] | None = None):
        """``tls``: serve HTTPS with this context. ``public``: routes answered without a credential.
        ``authorize(route, credential)``: raises Unauthorized; default: the credential must be ``token``."""
        self.token, self.routes, self.raw, self.max_bytes, self.name = token, routes, raw, max_bytes, name
        self.tls, self.public, self.authorize = tls, public, authorize or self._token_only
        self.rejected: Counter = Counter()
        self.conns: set = set()  # open (keep-alive) connections: closed with the server
        self.conns_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                if server.tls is not None:  # the handshake runs here, in this connection's thread, not in accept
                    self.request.settimeout(30)
                    self.request = server.tls.wrap_socket(self.request, server_side=True)
                    self.request.settimeout(None)
                with server.conns_lock:
                    server.conns.add(self.request)
                super().setup()
                # Headers and body go out as separate writes; with Nagle + delayed ACK each small
                # request would stall ~40 ms (measured: 0.16 s of learner idle per step over loopback).
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def finish(self):
                with server.conns_lock:
                    server.conns.discard(self.request)
                super().finish()

            def log_message(self, fmt, *args):  # quiet: errors are logged by _handle
                pass

            def do_POST(self):
                server._handle(self, "POST")

            def do_GET(self):
                server._handle(self, "GET")

        self.httpd = _Server((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def url(self, host: str | None = None) -> str:
        h, p = self.address
        return f"{'https' if self.tls else 'http'}://{host or h}:{p}"

    def start(self) -> "JsonServer":
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.is_alive():  # shutdown() waits for serve_forever, which never ran if not started
            self.httpd.shutdown()
        self.httpd.server_close()
        with self.conns_lock:  # a keep-alive connection would otherwise go on being served by a closed server
            conns, self.conns = list(self.conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _token_only(self, _route: str, credential: str) -> None:
        if not hmac.compare_digest(credential.encode(), self.token.encode()):
            raise Unauthorized("missing or wrong token")

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        key = f"{method} {h.path.split('?')[0]}"
        status, payload = 200, None
        try:
            length = int(h.headers.get("Content-Length") or 0)
            if length > self.max_bytes:
                raise BadRequest(f"body of {length} bytes exceeds the {self.max_bytes}-byte limit")
            data = h.rfile.read(length) if length else b""
            auth = h.headers.get("Authorization", "")
            if key not in self.public:
                self.authorize(key, auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else "")
            route = self.routes.get(key)
            if route is None:
                status, payload = 404, {"error": f"no route {key}"}
            else:
                if key in self.raw:
                    body: dict | bytes = data
                else:
                    try:
                        body = json.loads(data or b"{}")
                    except ValueError as e:
                        raise BadRequest(f"malformed JSON: {e}") from None
                    if not isinstance(body, dict):
                        raise BadRequest("JSON body must be an object")
                payload = route(body, dict(h.headers))
        except BadRequest as e:
            status, payload = e.status, {"error": str(e)}
            self.rejected[type(e).__name__] += 1
            log.warning("%s: rejected %s from %s: %s", self.name, key, h.client_address[0], e)
        except Exception as e:  # a bug on our side: tell the sender, keep serving
            status, payload = 500, {"error": f"{type(e).__name__}: {e}"}
            log.exception("%s: error in %s", self.name, key)
        out = json.dumps(payload).encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(out)))
            h.end_headers()
            h.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A peer that vanishes mid-request (a killed worker) is one log line, not a traceback on stderr."""
        import sys

        log.warning("connection from %s dropped: %s", client_address[0], sys.exc_info()[1])


class Client:
    """A persistent-connection client for one server. An ``https`` URL needs ``ca_file`` (the run's pinned CA) and
    ``server_name``, the name the server's certificate must carry (LEARNER_NAME or PEER_NAME), whatever address
    the URL names."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0, ca_file: str | None = None,
                 server_name: str | None = None):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        if self.base_url.startswith("https://"):
            if not (ca_file and server_name):
                raise ValueError(f"{base_url}: an https URL needs the run's CA (join with --ca-hash)")
            # per request, not on the session: REQUESTS_CA_BUNDLE in the environment would override the session's
            self.verify: str | bool = ca_file
            self.session.mount("https://", _PinnedName(server_name))
        else:
            self.verify = True

    def post(self, path: str, body: dict | None = None, data: bytes | None = None,
             headers: dict | None = None, timeout_s: float | None = None) -> Any:
        r = self.session.post(self.base_url + path, json=body if data is None else None, data=data,
                              headers=headers, timeout=timeout_s or self.timeout_s, verify=self.verify)
        if r.status_code != 200:
            raise RemoteError(r.status_code, _error_text(r))
        return r.json()

    def close(self) -> None:
        self.session.close()


class _PinnedName(requests.adapters.HTTPAdapter):
    """Verify the server's certificate for a fixed name instead of the URL's host: run certificates name a role
    (learner or peer), not an address, so workers behind NAT or renamed hosts need no new certificate."""

    def __init__(self, server_name: str):
        self.server_name = server_name
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs.update(server_hostname=self.server_name, assert_hostname=self.server_name)
        super().init_poolmanager(*args, **kwargs)


class RemoteError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _error_text(r: requests.Response) -> str:
    try:
        return r.json().get("error", r.text)
    except ValueError:
        return r.text[:500]


# ---------------------------------------------------------------------- TLS pinned to the run

LEARNER_NAME = "learner.echo2.invalid"  # the coordinator and the learner's relay origin (also a PEER)
PEER_NAME = "peer.echo2.invalid"  # every relay source and snapshot receiver


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
    fd, path = tempfile.mkstemp(suffix=".pem")  # ssl loads keys from files only; 0600, removed at once
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + key_pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx


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

    def issue(self, names: list[str]) -> tuple[bytes, bytes]:
        """A fresh key and a certificate for ``names`` signed by the run CA: (cert PEM, key PEM)."""
        key = _new_key()
        return _certificate(names[0], key.public_key(), self._key, names, ca=False), _key_pem(key)

    def trust(self) -> Trust:
        """The learner's own: its servers present a certificate for LEARNER_NAME and PEER_NAME."""
        return Trust(self.ca_pem, self.ca_file, server_context(*self.issue([LEARNER_NAME, PEER_NAME])))


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


def _certificate(common_name: str, public_key, signing_key, names: list[str] | None, ca: bool) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "echo2 run CA")])
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=365))
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
