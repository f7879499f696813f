"""Order sequence numbers (echo2/coordinator/order_seq.py) increase across coordinator restarts and clock steps."""

from __future__ import annotations

import time

import pytest

from conftest import holds_within
from echo2.coordinator import order_seq
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.coordinator.order_seq import RESERVE_US, OrderSequence
from echo2.worker.peer import SnapshotReceiver

SECRET = "secret"


@pytest.mark.parametrize("clock_us, expected", [
    ([100, 200, 300], [100, 200, 300]),  # the clock, while it moves forward
    ([100, 100, 100], [100, 101, 102]),  # a clock slower than the orders
    ([500, 100, 200], [500, 501, 502]),  # stepped back: one more than the last, until the clock passes it
])
def test_numbers_increase_whatever_the_clock_does(monkeypatch, clock_us, expected):
    ticks = iter(clock_us)
    monkeypatch.setattr(order_seq, "wall_us", lambda: next(ticks))
    seqs = OrderSequence()
    assert [seqs.next() for _ in clock_us] == expected


def test_a_restarted_coordinator_starts_above_everything_handed_out(tmp_path, monkeypatch):
    monkeypatch.setattr(order_seq, "wall_us", lambda: 1_000)
    first = OrderSequence(str(tmp_path))
    used = [first.next() for _ in range(5)]
    assert (tmp_path / order_seq.FILE).read_text().strip() == str(1_000 + RESERVE_US)  # one write, ahead of use
    monkeypatch.setattr(order_seq, "wall_us", lambda: 10)  # and the clock stepped back
    assert OrderSequence(str(tmp_path)).next() > max(used)


def test_workers_take_a_restarted_coordinators_orders_after_a_clock_step_back(tmp_path, monkeypatch):
    """Orders are numbered from the clock; a coordinator restarted while the clock is an hour behind must still be
    obeyed (without the persisted mark every worker refused its orders as replays for that hour)."""
    r = SnapshotReceiver.of_run(SECRET, lambda *a: None).start()
    try:
        bc = RelayBroadcaster(SECRET, topology="chain", state_dir=str(tmp_path))
        bc.add_peer("r", r.url, r.relay_addr)
        assert holds_within(lambda: r.token == bc.token, 10)
        bc.close()
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() - 3600 * 10**9)
        restarted = RelayBroadcaster(SECRET, topology="chain", state_dir=str(tmp_path))
        try:
            restarted.add_peer("r", r.url, r.relay_addr)
            assert holds_within(lambda: r.token == restarted.token, 10), "the restarted coordinator's key order " \
                                                                           "was refused"
        finally:
            restarted.close()
    finally:
        r.close()
