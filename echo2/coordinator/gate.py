"""Who may call the coordinator, and the run's TLS material: credentials, revocations, the run CA's routes.

    request ── TLS (the run CA's certificate, off loopback) ──► JsonServer ── Gate.authorize(route, credential)
                                                                               │ run secret: any route
                                                                               │ worker credential: worker routes,
                                                                               │   until its name is revoked (403)
                                                                               └ else 401

A worker credential is ``name:HMAC(run secret, name)`` (credential.worker_credential), so the gate needs no table of
workers. Who sent a request is decided once, by ``authorize`` as the request is admitted (one credential per
request: net.http refuses two), and handed to the route as a ``Caller``; a route asks ``caller(headers)`` for it and
never reads the Authorization header again, and the run secret is a Caller that says so (``secret``), never "not a
worker credential". The coordinator binds each worker id to the name it registered with. Revocations are kept in
``<run dir>/revoked.txt``, written before they take effect (``revoke``: on a full disk an operator's revocation
does nothing and says so; a verdict of the rollout checks takes effect all the same and is reported): a restarted
coordinator or a resumed learner refuses the same names; a fresh run in a used directory starts with none. The gate also answers the routes that hand out what joining needs: the run CA
(public: the worker checks its fingerprint), a certificate for the worker's own servers, and the public key
the learner's snapshot manifests and orders are signed for.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any

from echo2.broadcast.manifest import verify_key
from echo2.coordinator import schemas
from echo2.credential import credential_name
from echo2.net.http import BadRequest, Revoked, Unauthorized
from echo2.net.tls import PEER_NAME, RunCA, Trust, credential_peer_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a worker credential's ``name``, or the run ``secret`` (the learner's own agents and the
    operator). Established by Gate.authorize as the request is admitted."""

    name: str | None = None
    secret: bool = False

    @property
    def connection_key(self) -> str | None:
        """What its connections are counted under (httpd.Limits.max_connections_per_principal): its name; the run
        secret's are not capped."""
        return None if self.secret else self.name


RUN_SECRET = Caller(secret=True)


class NotSaved(BadRequest):
    """A revocation could not be written down (a full disk): it was not applied (HTTP 507)."""

    status = 507


class Gate:
    ADMIN_ROUTES = frozenset({"POST /revoke"})
    PUBLIC_ROUTES = frozenset({"GET /ca"})

    def __init__(self, secret: str, run_dir: str | None, fresh: bool, tls_dir: str | None):
        self.secret = secret
        self.ca = RunCA(tls_dir) if tls_dir else None
        self.trust: Trust | None = self.ca.trust() if self.ca else None
        self.revoked_path = os.path.join(run_dir, "revoked.txt") if run_dir else None
        if self.revoked_path and fresh and os.path.exists(self.revoked_path):
            os.unlink(self.revoked_path)  # a fresh run in a used directory: the old revocations are not this run's
        self.revoked: set[str] = set()
        self.unwritten: set[str] = set()  # revoked in memory, not (yet) written down: a full disk
        if self.revoked_path and os.path.exists(self.revoked_path):
            with open(self.revoked_path, encoding="utf-8") as f:
                self.revoked = {line.strip() for line in f if line.strip()}

    def authorize(self, route: str, credential: str) -> Caller:
        """Who ``credential`` is: the run secret may call anything; a worker credential the worker routes, until its
        name is revoked; anything else is refused (401)."""
        if hmac.compare_digest(credential.encode(), self.secret.encode()):
            return RUN_SECRET
        name = credential_name(self.secret, credential)
        if name is None:
            raise Unauthorized("missing or wrong token (the run secret or a worker credential)")
        if name in self.revoked:
            raise Revoked(f"the credential of worker {name!r} was revoked")
        if route in self.ADMIN_ROUTES:
            raise Unauthorized(f"{route} needs the run secret, not a worker credential")
        return Caller(name)

    @staticmethod
    def caller(headers: Any) -> Caller:
        """Who sent a request, as its admission established (never read from its headers again)."""
        identity = getattr(headers, "identity", None)
        if not isinstance(identity, Caller):  # a public route, or a route not served through authorize: nobody
            raise Unauthorized("no credential was established for this request")
        return identity

    def revoke(self, name: Any, *, verdict: bool = False) -> bool:
        """Revoke ``name`` for the rest of the run (idempotent), written down before it takes effect. If it cannot be
        written (a full disk): an operator's revocation raises NotSaved and nothing changes, so that it can be
        retried whole; a ``verdict`` (the rollout checks caught a forger) takes effect in memory all the same (a
        forger must not keep working because a disk filled) and is reported. Returns whether it was written."""
        if not isinstance(name, str) or not name:
            raise BadRequest("'name' must be a worker name")
        if name in self.revoked and name not in self.unwritten:
            return True
        try:
            self._append(name)
        except OSError as e:
            if not verdict and name not in self.revoked:
                raise NotSaved(f"could not record the revocation of {name!r} in {self.revoked_path} ({e}): nothing "
                               "was revoked; free space and revoke again") from None
            if not verdict:  # in effect already (a verdict's), still not written down
                raise NotSaved(f"{name!r} is revoked in this coordinator, but still not recorded in "
                               f"{self.revoked_path} ({e}): free space and revoke again") from None
            self.unwritten.add(name)
            self.revoked.add(name)
            log.error("could not record the revocation of %r in %s (%s): it holds for this coordinator only (a "
                      "restarted one would let it in again); free space and revoke it again", name,
                      self.revoked_path, e)
            return False
        self.unwritten.discard(name)
        self.revoked.add(name)
        return True

    def _append(self, name: str) -> None:
        """One line in revoked.txt, on disk before this returns; a write that fails leaves no partial line."""
        if not self.revoked_path:
            return
        data = (name + "\n").encode()
        fd = os.open(self.revoked_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            try:
                if os.write(fd, data) != len(data):  # a short write: the disk filled part-way
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass
                raise
        finally:
            os.close(fd)

    def routes(self) -> dict[str, Any]:
        return {"GET /ca": self._ca, "POST /certificate": self._certificate, "POST /manifest-key": self._manifest_key}

    def _ca(self, _body, _headers) -> dict:
        """The run CA's certificate (public): a joining worker checks it against its pinned fingerprint."""
        if self.ca is None:
            raise BadRequest("this coordinator does not use TLS")
        return {"ca": self.ca.ca_pem.decode()}

    def _certificate(self, body, headers) -> dict:
        """A key and certificate for a worker's snapshot and relay servers, for the name every peer verifies and its
        caller's credential (which the learner checks before it sends that worker an order)."""
        schemas.parse(schemas.Empty, body)
        if self.ca is None:
            raise BadRequest("this coordinator does not use TLS")
        who = self.caller(headers)
        cert, key = self.ca.issue([PEER_NAME, credential_peer_name(None if who.secret else who.name)])
        return {"cert": cert.decode(), "key": key.decode()}

    def _manifest_key(self, body, _headers) -> dict:
        """What a worker's snapshot receiver needs before the learner's first order: the public key the learner's
        manifests and orders are signed for (broadcast.manifest.verify_key). The relay key itself is random and
        comes with each order (coordinator/broadcaster.py)."""
        schemas.parse(schemas.Empty, body)
        return {"manifest_key": verify_key(self.secret)}
