"""Who holds a server's connections, and whether one more may: the connection policy of a port strangers reach.

    accept ──► Slots.admit(address) ──► anonymous slot ──(a request passes ``authorize``)──► Slots.authenticate
               │ refused: its address holds too many             │ refused: its principal holds too many
               │ full: the oldest anonymous connection is cut     └─► authenticated slot ──► Slots.release (closed)
               └ full of authenticated connections: refused

A connection is *anonymous* from accept (a TLS handshake in progress included) until one of its requests is admitted
with a credential; then it is *authenticated*, and counted under the principal its credential names (a worker
credential; the run secret is not counted). What it buys:

* **Per address.** One address (an IPv4 address, or an IPv6 /64: one host holds a whole /64) holds at most
  ``max_anonymous_per_address`` anonymous connections and ``max_connections_per_address`` in all: one stranger's
  machine cannot take the cap.
* **Room for workers.** Anonymous connections hold at most ``anonymous_share`` of the cap; the rest is for
  authenticated ones. When the cap is full, a newcomer cuts the oldest anonymous connection rather than being
  refused: holding connections open gains an outsider nothing, since an honest client authenticates within one
  round trip of connecting while a held connection waits to be cut. Only when every connection is authenticated is
  a newcomer refused.
* **Per principal.** One worker credential holds at most ``max_connections_per_principal`` authenticated
  connections, from however many addresses.

``exempt`` addresses (the learner host's own loopback, where its local agents connect from) are not capped per
address; they count against the totals like any other. Pure counting, no sockets: BackgroundServer (httpd.py)
calls it on its event loop's thread only, and cuts what ``admit`` says to cut.
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlotLimits:
    """The policy's numbers (httpd.Limits carries them, with their reasons)."""

    max_connections: int = 4096
    anonymous_share: float = 0.5
    max_anonymous_per_address: int = 16
    max_connections_per_address: int = 512
    max_connections_per_principal: int = 64
    exempt: frozenset[str] = frozenset({"127.0.0.1", "::1"})

    def __post_init__(self):
        if not 0 < self.anonymous_share <= 1 or min(self.max_connections, self.max_anonymous_per_address,
                                                     self.max_connections_per_address,
                                                     self.max_connections_per_principal) < 1:
            raise ValueError(f"connection limits {self}: every cap >= 1, 0 < anonymous_share <= 1")

    @property
    def max_anonymous(self) -> int:
        return max(1, math.floor(self.anonymous_share * self.max_connections))


@dataclass(eq=False)
class Slot:
    """One accepted connection's place. ``cut``: how to close it when a newcomer needs its place (set by the
    server: the handshake's task, then the transport)."""

    address: str
    exempt: bool
    principal: str | None = None  # authenticated as this worker credential (None: anonymous, or the run secret)
    authenticated: bool = False
    held: bool = True
    cut: Callable[[], None] = field(default=lambda: None)


def address_key(host: str) -> str:
    """What one client holds connections as: its IPv4 address (an IPv4-mapped IPv6 one as IPv4), or its IPv6 /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Slots:
    def __init__(self, limits: SlotLimits):
        self.limits = limits
        self.anonymous: OrderedDict[Slot, None] = OrderedDict()  # oldest first: the first to be cut
        self.authenticated = 0
        self.anonymous_by_address: Counter = Counter()
        self.by_address: Counter = Counter()
        self.by_principal: Counter = Counter()

    @property
    def open(self) -> int:
        return len(self.anonymous) + self.authenticated

    def admit(self, host: str) -> tuple[Slot | None, str | None, list[Slot]]:
        """A newly accepted connection from ``host``: (its slot, None, the slots to cut for it), or (None, the kind
        of refusal, []): ``TooManyFromAddress`` or ``TooManyConnections``."""
        lim = self.limits
        key = address_key(host)
        exempt = host in lim.exempt or key in lim.exempt
        if not exempt and (self.anonymous_by_address[key] >= lim.max_anonymous_per_address
                           or self.by_address[key] >= lim.max_connections_per_address):
            return None, "TooManyFromAddress", []
        cut: list[Slot] = []
        anonymous, oldest = len(self.anonymous), iter(self.anonymous)
        while (anonymous - len(cut) >= lim.max_anonymous or self.open - len(cut) >= lim.max_connections) and \
                len(cut) < anonymous:
            cut.append(next(oldest))
        if self.open - len(cut) >= lim.max_connections or anonymous - len(cut) >= lim.max_anonymous:
            return None, "TooManyConnections", []
        for old in cut:
            self.release(old)
        slot = Slot(key, exempt)
        self.anonymous[slot] = None
        self.anonymous_by_address[key] += 1
        self.by_address[key] += 1
        return slot, None, cut

    def authenticate(self, slot: Slot, principal: str | None) -> str | None:
        """A request on ``slot`` passed its credential check as ``principal`` (None: one not counted, the run
        secret). Returns None, or ``TooManyForCredential`` when that principal holds its cap already (the request
        is refused and the connection closed)."""
        if not slot.held:
            return None
        if slot.authenticated and slot.principal == principal:
            return None
        if principal is not None and self.by_principal[principal] >= self.limits.max_connections_per_principal:
            return "TooManyForCredential"
        if slot.authenticated:  # the same connection, another credential: counted under the new one
            self._uncount_principal(slot)
        else:
            del self.anonymous[slot]
            self._decrement(self.anonymous_by_address, slot.address)
            self.authenticated += 1
        slot.authenticated, slot.principal = True, principal
        if principal is not None:
            self.by_principal[principal] += 1
        return None

    def release(self, slot: Slot) -> None:
        """The connection closed (or was cut): its place is free. Idempotent."""
        if not slot.held:
            return
        slot.held = False
        if slot.authenticated:
            self.authenticated -= 1
            self._uncount_principal(slot)
        else:
            del self.anonymous[slot]
            self._decrement(self.anonymous_by_address, slot.address)
        self._decrement(self.by_address, slot.address)

    def _uncount_principal(self, slot: Slot) -> None:
        if slot.principal is not None:
            self._decrement(self.by_principal, slot.principal)

    @staticmethod
    def _decrement(counter: Counter, key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]  # bounded by what is open now, not by every address ever seen
