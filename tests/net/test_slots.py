"""The connection policy (echo2/net/slots.py), table-driven: per address, per credential, room kept for
authenticated connections, the oldest anonymous one cut for a newcomer, every count back to zero when all close."""

from __future__ import annotations

import pytest

from echo2.net.slots import SlotLimits, Slots, address_key

LIMITS = SlotLimits(max_connections=8, anonymous_share=0.5, max_anonymous_per_address=3,
                    max_connections_per_address=5, max_connections_per_principal=2)


@pytest.mark.parametrize("host, key", [
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),  # IPv4-mapped: the same client
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),  # one host holds a whole /64
    ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("?", "?"),
])
def test_an_address_is_what_one_client_holds(host, key):
    assert address_key(host) == key


def test_one_address_holds_its_share_and_no_more():
    slots = Slots(LIMITS)
    held = [slots.admit("198.51.100.1")[0] for _ in range(3)]
    assert all(held)
    assert slots.admit("198.51.100.1")[:2] == (None, "TooManyFromAddress")  # its 4th anonymous one
    other, why, cut = slots.admit("198.51.100.2")
    assert other is not None and why is None and cut == []  # another address is not affected
    for s in held:  # authenticated, they no longer count as anonymous: two more anonymous from it, then its total
        assert slots.authenticate(s, None) is None
    assert slots.admit("198.51.100.1")[0] and slots.admit("198.51.100.1")[0]
    assert slots.admit("198.51.100.1")[:2] == (None, "TooManyFromAddress")  # 5 in all


def test_exempt_addresses_are_capped_only_in_all():
    slots = Slots(SlotLimits(max_connections=8, max_anonymous_per_address=1, max_connections_per_address=1))
    a = [slots.admit("127.0.0.1")[0] for _ in range(4)]
    assert all(a)
    for s in a:
        slots.authenticate(s, None)
    assert all(slots.admit("::1")[0] for _ in range(4))


def test_a_full_anonymous_pool_cuts_its_oldest_for_a_newcomer():
    """Anonymous connections hold at most half the cap (4 of 8); the next one cuts the oldest, never an
    authenticated one."""
    slots = Slots(LIMITS)
    worker = slots.admit("192.0.2.50")[0]
    assert slots.authenticate(worker, "box17") is None
    stalls = [slots.admit(f"192.0.2.{i}")[0] for i in range(4)]
    new, why, cut = slots.admit("192.0.2.99")
    assert new is not None and why is None and cut == [stalls[0]] and not stalls[0].held
    assert worker.held and slots.open == 5 and len(slots.anonymous) == 4


def test_only_a_cap_of_authenticated_connections_refuses_a_newcomer():
    slots = Slots(SlotLimits(max_connections=4, anonymous_share=0.5, max_connections_per_principal=10))
    for i in range(4):
        s = slots.admit(f"192.0.2.{i}")[0]
        assert slots.authenticate(s, "box") is None
    assert slots.admit("192.0.2.9")[:2] == (None, "TooManyConnections")


def test_one_credential_holds_its_share_from_any_address():
    slots = Slots(LIMITS)
    a, b, c = (slots.admit(f"192.0.2.{i}")[0] for i in range(3))
    assert slots.authenticate(a, "box17") is None and slots.authenticate(b, "box17") is None
    assert slots.authenticate(c, "box17") == "TooManyForCredential"
    assert slots.authenticate(c, None) is None  # the run secret is not counted per credential
    slots.release(a)
    d = slots.admit("192.0.2.7")[0]
    assert slots.authenticate(d, "box17") is None


def test_every_count_returns_to_zero():
    slots = Slots(LIMITS)
    opened = []
    for i in range(12):
        s, _, cut = slots.admit(f"192.0.2.{i % 3}")
        if s is not None:
            opened.append(s)
            if i % 2:
                slots.authenticate(s, f"p{i % 4}")
    for s in opened + opened:  # released twice: idempotent
        slots.release(s)
    assert slots.open == 0 and not slots.anonymous and slots.authenticated == 0
    assert not slots.anonymous_by_address and not slots.by_address and not slots.by_principal
