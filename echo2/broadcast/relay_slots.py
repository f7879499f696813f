"""Who may hold a relay server's connections (broadcast/relay.py's RelayServer): a pure policy, no sockets.

A relay server (a worker's, and the learner's origin) serves a bounded number of connections, one thread each.
Anyone who can reach its port can open one, and anyone holding the relay key (every worker) can make valid
requests; what earns a slot that lasts is a **ticket**: the learner's signature on "holder h may fetch version v
(base b) over k lanes from this source" (manifest.relay_ticket), one per source in every order, shown with each
request to that source alone. So:

    accept ──► unticketed ── request with a valid ticket for a version held here ──► ticketed (holder h, v)
      │          │  (its handshake and first request within request_timeout_s;        idles up to
      │          │   a request without a ticket is served, then it idles that long      idle_timeout_s
      │          │   at most; an error answer drops it)                                    between requests
      │          └─ evicted, oldest first, when the server is full and someone new arrives
      └─ refused at once: over ``per_address`` unticketed connections from one address (an IPv6 /64 counts as
         one), or over its rate of new connections (``RATE_PER_ADDRESS``), or full and nothing evictable

A ticketed connection is never evicted for a newcomer while its version is current (the holder's order is
running), and a holder gets at most ``lanes + 2`` ticketed connections here (a lane each, a repair, one spare):
an insider with a valid order cannot take more. One whose version is stale is evictable again, after every
unticketed one. An outsider reconnecting as each deadline passes, or an insider parking connections with one
request each, then holds only evictable slots: an honest fetcher, which shows its ticket in its first request
within a round trip, always gets in, unless strangers arrive faster than max_conns per round trip: the rate per
address makes that take many addresses. A ticket names its source, so a source that is an attacker's worker cannot
show the ticket it was shown at the holder's other sources and take the holder's slots there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import count

from echo2.broadcast.manifest import BadSnapshot, check_ticket

PER_ADDRESS = 32
"""Unticketed connections from one address (an IPv6 /64) at once: a NATed cluster's workers share an address,
and each of their connections is unticketed only until its first request; a stranger gets no more."""

RATE_PER_ADDRESS = 8.0
"""New connections per second one address may open, after a burst of ``per_address``: a worker opens a few per
source per snapshot and keeps them; a stranger evicting newcomers as fast as it can gets no further than this."""

MAX_BUCKETS = 4096
"""Addresses whose rate is tracked at once; past it, those whose allowance is full again are forgotten."""

MAX_TICKET_CHARS = 512
"""The longest ticket read: a worker id, three numbers, a source tag and a signature (manifest.relay_ticket)."""

SPARE_PER_HOLDER = 2
"""Ticketed connections a holder gets beyond its lanes: one for repairs (re-fetching a bad chunk), one spare (a
connection being replaced)."""


def ticket_of(key: str | None, req: dict, own_tag: str | None) -> tuple[str, int, int] | None:
    """(holder, version, lanes) of the ticket a relay request shows; None if it shows none, or one made for another
    source (a source showing what its fetcher showed it: it earns nothing here, and is served as any request
    without a ticket), or if ``key`` (the learner's public key) or ``own_tag`` (this source's manifest.source_tag)
    is not known here. ValueError if the ticket is not the learner's, or is for another version than the request
    asks for."""
    ticket = req.get("ticket")
    if ticket is None or key is None or own_tag is None:
        return None
    try:
        holder, version, base, lanes, tag = check_ticket(key, str(ticket)[:MAX_TICKET_CHARS])
    except BadSnapshot as e:
        raise ValueError(str(e)) from None
    if tag != own_tag:
        return None
    if (version, base) != (req.get("version"), req.get("base")):
        raise ValueError(f"a ticket for v{version} (base {base}), not for the version asked for")
    return holder, version, lanes


def address_key(host: str) -> str:
    """What per-address limits count by: the IPv4 address, or the /64 of an IPv6 one (a host gets a /64)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@dataclass
class Slot:
    address: str
    order: int  # admission order: the oldest is evicted first
    holder: str | None = None  # the ticket's holder; None: unticketed
    version: int = -1  # the ticket's version


@dataclass
class Slots:
    max_conns: int
    per_address: int = PER_ADDRESS
    rate_per_address: float = RATE_PER_ADDRESS
    slots: dict[Hashable, Slot] = field(default_factory=dict)
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # address -> (allowance, when)
    _order: count = field(default_factory=count)

    def admit(self, conn: Hashable, host: str, now: float,
              stale: Callable[[int], bool] = lambda version: False) -> tuple[bool, list[Hashable]]:
        """A new connection from ``host`` at time ``now`` (s, monotonic): (admitted, connections to evict to make
        room). ``stale(v)``: whether a ticket for version v no longer earns its slot."""
        address = address_key(host)
        if sum(1 for s in self.slots.values() if s.holder is None and s.address == address) >= self.per_address:
            return False, []
        if not self._allowed(address, now):
            return False, []
        evict: list[Hashable] = []
        if len(self.slots) >= self.max_conns:
            victim = self._evictable(stale)
            if victim is None:
                return False, []
            evict.append(victim)
            del self.slots[victim]
        self.slots[conn] = Slot(address, next(self._order))
        return True, evict

    def ticketed(self, conn: Hashable, holder: str, version: int, lanes: int) -> bool:
        """``conn`` showed a valid ticket of ``holder`` for ``version`` over ``lanes`` lanes: it keeps its slot (True),
        unless the holder has its share already (False: it stays unticketed)."""
        slot = self.slots.get(conn)
        if slot is None:
            return False
        if slot.holder != holder:
            held = sum(1 for c, s in self.slots.items() if s.holder == holder and c != conn)
            if held >= max(1, lanes) + SPARE_PER_HOLDER:
                slot.holder, slot.version = None, -1
                return False
        slot.holder, slot.version = holder, version
        return True

    def unticketed(self, conn: Hashable) -> None:
        """``conn`` made a request without a ticket: evictable again."""
        slot = self.slots.get(conn)
        if slot is not None:
            slot.holder, slot.version = None, -1

    def release(self, conn: Hashable) -> None:
        self.slots.pop(conn, None)

    def is_ticketed(self, conn: Hashable) -> bool:
        slot = self.slots.get(conn)
        return slot is not None and slot.holder is not None

    def _allowed(self, address: str, now: float) -> bool:
        """Take one from the address's allowance of new connections (a token bucket: ``per_address`` at most,
        refilled at ``rate_per_address``)."""
        allowance, when = self.buckets.get(address, (float(self.per_address), now))
        allowance = min(float(self.per_address), allowance + (now - when) * self.rate_per_address)
        if len(self.buckets) >= MAX_BUCKETS:
            full = self.per_address / self.rate_per_address
            self.buckets = {a: (n, t) for a, (n, t) in self.buckets.items() if now - t < full}
        if allowance < 1:
            self.buckets[address] = (allowance, now)
            return False
        self.buckets[address] = (allowance - 1, now)
        return True

    def _evictable(self, stale: Callable[[int], bool]) -> Hashable | None:
        """The oldest unticketed connection; else the oldest ticketed for a stale version; else None."""
        unticketed = [(s.order, c) for c, s in self.slots.items() if s.holder is None]
        if unticketed:
            return min(unticketed)[1]
        old = [(s.order, c) for c, s in self.slots.items() if stale(s.version)]
        return min(old)[1] if old else None
