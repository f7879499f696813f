"""Who may call the coordinator, and the run's TLS material: credentials, revocations, the run CA's routes.

    request ── TLS (the run CA's certificate, off loopback) ──► JsonServer ── Gate.authorize(route, credential)
                                                                               │ run secret: any route
                                                                               │ worker credential: worker routes,
                                                                               │   until its name is revoked (403)
                                                                               └ else 401

A worker credential is ``name:HMAC(run secret, name)`` (credential.worker_credential), so the gate needs no table of
workers; the coordinator binds each worker id to the name it registered with (``caller``). Revocations are kept in
``<run dir>/revoked.txt``: a restarted coordinator or a resumed learner refuses the same names; a fresh run in a
used directory starts with none. The gate also answers the routes that hand out what joining needs: the run CA
(public: the worker checks its fingerprint), a certificate for the worker's own servers, and the public key
the learner's snapshot manifests and orders are signed for.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from echo2.broadcast.manifest import verify_key
from echo2.coordinator import schemas
from echo2.credential import credential_name
from echo2.net.http import BadRequest, Revoked, Unauthorized
from echo2.net.tls import PEER_NAME, RunCA, Trust


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
        if self.revoked_path and os.path.exists(self.revoked_path):
            with open(self.revoked_path, encoding="utf-8") as f:
                self.revoked = {line.strip() for line in f if line.strip()}

    def authorize(self, route: str, credential: str) -> None:
        """The run secret may call anything; a worker credential the worker routes, until its name is revoked."""
        if hmac.compare_digest(credential.encode(), self.secret.encode()):
            return
        name = credential_name(self.secret, credential)
        if name is None:
            raise Unauthorized("missing or wrong token (the run secret or a worker credential)")
        if name in self.revoked:
            raise Revoked(f"the credential of worker {name!r} was revoked")
        if route in self.ADMIN_ROUTES:
            raise Unauthorized(f"{route} needs the run secret, not a worker credential")

    def caller(self, headers: dict[str, str]) -> str | None:
        """The worker name of an authorized request's credential; None for the run secret."""
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        return credential_name(self.secret, auth.removeprefix("Bearer "))

    def revoke(self, name: Any) -> str:
        """Record ``name`` as revoked for the rest of the run (idempotent); returns it."""
        if not isinstance(name, str) or not name:
            raise BadRequest("'name' must be a worker name")
        if name not in self.revoked:
            self.revoked.add(name)
            if self.revoked_path:
                with open(self.revoked_path, "a", encoding="utf-8") as f:
                    f.write(name + "\n")
        return name

    def routes(self) -> dict[str, Any]:
        return {"GET /ca": self._ca, "POST /certificate": self._certificate, "POST /manifest-key": self._manifest_key}

    def _ca(self, _body, _headers) -> dict:
        """The run CA's certificate (public): a joining worker checks it against its pinned fingerprint."""
        if self.ca is None:
            raise BadRequest("this coordinator does not use TLS")
        return {"ca": self.ca.ca_pem.decode()}

    def _certificate(self, body, _headers) -> dict:
        """A key and certificate for a worker's snapshot and relay servers, for the name every peer verifies."""
        schemas.parse(schemas.Empty, body)
        if self.ca is None:
            raise BadRequest("this coordinator does not use TLS")
        cert, key = self.ca.issue([PEER_NAME])
        return {"cert": cert.decode(), "key": key.decode()}

    def _manifest_key(self, body, _headers) -> dict:
        """What a worker's snapshot receiver needs before the learner's first order: the public key the learner's
        manifests and orders are signed for (broadcast.manifest.verify_key). The relay key itself is random and
        comes with each order (coordinator/broadcaster.py)."""
        schemas.parse(schemas.Empty, body)
        return {"manifest_key": verify_key(self.secret)}
