"""The in-process link model: a node's emulated access link for tests and benchmarks without root.

Debt-based token buckets on the uplink and downlink plus a one-way latency (applied by relay.Snapshot as bytes
become "visible"). Optimistic next to real links (no slow start, no header overhead): the namespace testbed
(testbed.py) is what the broadcast figures use. Measurements: docs/design.md §5.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class TokenBucket:
    """Debt-based: charge first, then sleep off the debt, so late wake-ups lose no rate (wan-testbed.md §3)."""

    def __init__(self, mbit: float, burst_bytes: int | None = None):
        self.rate = mbit * 1e6 / 8
        self.burst = burst_bytes if burst_bytes is not None else max(int(self.rate * 0.02), 64 << 10)
        self.tokens, self.t = float(self.burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate) - n
            self.t = now
            debt = -self.tokens
        if debt > 0:
            time.sleep(debt / self.rate)


@dataclass
class Link:
    """A node's emulated access link: uplink and downlink caps (None: unshaped) and a one-way latency."""

    up_mbit: float | None = None
    down_mbit: float | None = None
    latency_s: float = 0.0
    up: TokenBucket | None = field(init=False, default=None)
    down: TokenBucket | None = field(init=False, default=None)

    def __post_init__(self):
        self.up = TokenBucket(self.up_mbit) if self.up_mbit else None
        self.down = TokenBucket(self.down_mbit) if self.down_mbit else None
