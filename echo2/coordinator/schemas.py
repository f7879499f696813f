"""What each of the coordinator's routes accepts: the JSON bodies as pydantic models, with their bounds.

A worker is a stranger: every number it declares reaches the planner (echo2/capacity.py, activation/), the deadline
policy (liveness.py) or the books, so each one is checked here first, inside the route, before anything
changes: the right type (no string, bool or float where an integer belongs), finite, positive where the
planner divides by it, and bounded so that no sum, product or DP table sized by it can overflow; strings and
lists are bounded too, and an unknown key is refused (a typo or an older agent is told so, not ignored).
``parse`` turns pydantic's ValidationError into a ``BadRequest`` naming each bad field, its value and why.

    body (dict, already JSON) ──parse(Model, body)──► Model instance (frozen) ──► the route handler

The bounds (each with its reason) are module constants, so that the planner's tests can run at their edges.
A pushed result's completions are checked by results.py (per result: one bad result costs its own group, not
the whole push); the push envelope is checked here. Addresses a worker declares (``snapshot_url``, ``relay``)
are checked by ``snapshot_url`` and ``relay_address``: the learner host will POST the relay key to the first
and point other workers at the second. A host is read the way the resolver reads it (``127.1``, ``2130706433``
and ``0x7f.1`` are 127.0.0.1 to it, and so to us), and on an exposed coordinator a worker may not name the
learner host, link-local (cloud metadata), multicast or reserved addresses, nor a private one unless it reaches us
from a private network itself (a cluster's workers name their cluster addresses; a stranger cannot point the
learner host into its network). Names are not resolved here (what a name resolves to can change after any check):
``localhost`` is refused, and with TLS on the learner host sends nothing to a server the run did not certify.
"""

from __future__ import annotations

import ipaddress
import re
import reprlib
import socket
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo2.net.http import BadRequest

from echo2.credential import WORKER_NAME

MAX_ID_CHARS = 64
"""Worker and group ids are ours (``w17``, ``g4021``); anything longer is not one."""
MAX_GROUPS_PER_REQUEST = 1024
"""Most groups one pull may ask for, one push may carry and one release may name: the in-flight cap
((S+1)·P groups) is far below this in any configuration we run."""
MAX_VERSION = 1 << 40
MAX_EVAL_ROWS = 10_000
"""Most held-out rows a worker evaluates in one job (coordinator/evaluation.py): every row's completion comes back in
one request, whose body is bounded before it is read (bounds.body_limits)."""
"""Policy versions are optimizer steps: no run gets near this."""
MAX_USD_PER_HOUR = 1000.0
"""Dearest worker price, $/h (an 8-GPU datacentre node rents for ~$100/h). The exact activation solver sizes
a table by total cents, so an unbounded price (1e308) overflowed it."""
MIN_MBIT, MAX_MBIT = 0.01, 1e6
"""Link rates, Mbit/s: 10 kbit/s up to 1 Tbit/s. The capacity model divides by them (0 stopped the reaper)."""
MAX_RTT_MS = 60_000.0
"""Round-trip time to the learner, ms: a minute is already no link to train over."""
MAX_ROLLOUTS_PER_S = 1e6
"""Most rollouts/s a worker's rate is taken to be: the coordinator's own measurement is clamped to it (it divides by
a push's elapsed time), and so is what a worker reports of itself (kept for diagnostics, never planned with)."""
MAX_CONTEXT_TOKENS = 1 << 24
MAX_TEXT_CHARS = 512
"""Free-form strings (an engine's name, a model's name or digest, an address)."""

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class Body(BaseModel):
    """Strict (no coercion: ``"1"`` is not 1, ``true`` is not a number), frozen, and unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Empty(Body):
    """Routes that take no arguments (``/certificate``, ``/manifest-key``)."""


class ModelClaim(Body):
    """What model a worker serves (echo2/models/identity.py); checked against the run's by ``mismatch``."""

    name: Text
    digest: Text


class Register(Body):
    """A worker's declaration: where to reach it, what it serves, its price and links (for the planner)."""

    snapshot_url: Text | None = None
    relay: Text | None = None
    engine: Annotated[str, Field(max_length=MAX_ID_CHARS)] = "?"
    usd_per_hour: float = Field(0.0, ge=0, le=MAX_USD_PER_HOUR, allow_inf_nan=False)
    down_mbit: float = Field(1000.0, ge=MIN_MBIT, le=MAX_MBIT, allow_inf_nan=False)
    up_mbit: float = Field(1000.0, ge=MIN_MBIT, le=MAX_MBIT, allow_inf_nan=False)
    rtt_ms: float = Field(0.0, ge=0, le=MAX_RTT_MS, allow_inf_nan=False)
    model: ModelClaim | None = None
    max_model_len: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)


class WorkerCall(Body):
    """Any call by a registered worker; ``version``: the policy version it holds (omitted: no claim)."""

    worker_id: Id
    version: int | None = Field(None, ge=0, le=MAX_VERSION)


class Heartbeat(WorkerCall):
    pass


class Leave(WorkerCall):
    pass


class Pull(WorkerCall):
    max_groups: int | None = Field(None, ge=1, le=MAX_GROUPS_PER_REQUEST)  # None: the coordinator's groups_per_pull


class Push(WorkerCall):
    results: list[dict[str, Any]] = Field(max_length=MAX_GROUPS_PER_REQUEST)
    # what the worker says of itself (clamped to MAX_ROLLOUTS_PER_S, not refused: an agent's own clock over a fast
    # batch can report anything; nothing is planned with it)
    rollouts_per_s: float | None = Field(None, ge=0, allow_inf_nan=False)


class EvalAnswer(WorkerCall):
    """A worker's greedy completions of the held-out rows (coordinator/evaluation.py), one result per row, in order,
    generated by ``version``."""

    job_id: Id
    results: list[dict[str, Any]] = Field(max_length=MAX_EVAL_ROWS)


class Release(WorkerCall):
    reason: Literal["generate_failed", "push_failed"]
    group_ids: list[Id] = Field(max_length=MAX_GROUPS_PER_REQUEST)


class Revoke(Body):
    name: Annotated[str, Field(pattern=f"^{WORKER_NAME.pattern}$")]


M = TypeVar("M", bound=Body)
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80


def parse(model: type[M], body: Any) -> M:
    """``body`` as ``model``, or a BadRequest that names every bad field, what it got and why."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(f"bad {model.__name__.lower()} request: {_explain(e)}") from None


def _explain(e: ValidationError, most: int = 4) -> str:
    parts = []
    for err in e.errors()[:most]:
        where = ".".join(map(str, err["loc"])) or "body"
        got = _BRIEF.repr(err.get("input"))  # bounded: a stranger's value may be long or deeply nested
        parts.append(f"{where}: {err['msg']} (got {got[:60] + '...' if len(got) > 60 else got})")
    more = e.error_count() - most
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


# ---------------------------------------------------------------------- addresses a worker declares

_HOSTNAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def snapshot_url(url: str, *, tls: bool, exposed: bool, client: str | None = None) -> str:
    """The control URL of a worker's snapshot receiver, which the learner host POSTs the relay key to.

    ``https://host:port`` when the run speaks TLS (the learner then verifies the run CA's peer certificate, so
    the key reaches only a server the run issued a certificate to), ``http://host:port`` when it does not (an
    https URL could not be verified). No credentials, path or query. ``exposed`` (the coordinator listens off
    loopback): a worker may not name loopback, link-local (cloud metadata), multicast, unspecified or reserved
    addresses, which would make the learner host talk to itself or its provider, nor a private one unless its own
    address (``client``, what it connected from) is private too."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise BadRequest(f"snapshot_url {url!r}: {e}") from None
    scheme = "https" if tls else "http"
    if parts.scheme != scheme:
        raise BadRequest(f"snapshot_url {url!r}: this run's workers serve {scheme}://HOST:PORT "
                         f"({'TLS with the run CA' if tls else 'no TLS'})")
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadRequest(f"snapshot_url {url!r}: only {scheme}://HOST:PORT")
    if port is None or not 0 < port < 65536:
        raise BadRequest(f"snapshot_url {url!r}: needs a port in 1..65535")
    _host(parts.hostname or "", "snapshot_url", exposed, client)
    return url


def relay_address(addr: str, *, exposed: bool, client: str | None = None) -> str:
    """A worker's relay node, ``host:port`` (an IPv6 host in brackets), which other workers will fetch from."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"'relay' must be 'host:port', got {addr!r}")
    _host(host[1:-1] if host.startswith("[") and host.endswith("]") else host, "relay", exposed, client)
    return addr


_NUMERIC = re.compile(r"[0-9a-fA-FxX.]+")
"""What inet_aton may read as an IPv4 address in one of its shorthand forms (decimal, octal or hex parts)."""


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` is to the resolver, if it is a literal one in any form: IPv6, a dotted quad, or one of
    inet_aton's shorthands (``127.1``, ``2130706433``, ``0x7f.1``, ``017700000001``, ``169.254.43518``); an
    IPv4-mapped IPv6 address as its IPv4 one. None: a host name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
        if _NUMERIC.fullmatch(host) and host[:1].isdigit():
            try:  # the C library's own parser: the one getaddrinfo applies to a name before any lookup
                ip = ipaddress.IPv4Address(socket.inet_aton(host.rstrip(".") or "x"))
            except OSError:
                pass
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip


def _private(host: str | None) -> bool:
    """Whether ``host`` (a client's address) is on a private, loopback or otherwise non-global network."""
    ip = address_of(host) if host else None
    return ip is not None and not ip.is_global


def _host(host: str, what: str, exposed: bool, client: str | None = None) -> None:
    ip = address_of(host)
    if ip is None:
        last = host.rstrip(".").rpartition(".")[2]
        if not _HOSTNAME.fullmatch(host) or last.isdigit():  # an all-numeric top label is no name (RFC 3696 2)
            raise BadRequest(f"{what}: {host!r} is neither an IP address nor a host name") from None
        if exposed and (host.lower() == "localhost" or host.lower().rstrip(".").endswith(".localhost")):
            raise BadRequest(f"{what}: {host!r} names the learner's own host; advertise an address it can reach")
        return
    if not exposed:
        return
    if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        raise BadRequest(f"{what}: {host} ({ip}) is not an address of another host (loopback, link-local, multicast, "
                         "unspecified or reserved); advertise the address the learner reaches it at")
    if not ip.is_global and not _private(client):
        raise BadRequest(f"{what}: {host} ({ip}) is a private address, and this worker connects from a public one "
                         f"({client}); advertise the address the learner reaches it at")
