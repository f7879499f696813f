"""Sequence numbers of the learner's orders to workers, increasing across coordinator restarts and clock steps.

A worker takes an order only if its number is above the last one it took (echo2/worker/peer.py: anything else
is a replay). Numbers are microseconds of wall-clock time, so that a restarted coordinator, which remembers
nothing, starts above its predecessor; but a clock stepped back (NTP, a VM migrated) then makes every order a
replay in every worker's eyes until the clock catches up. So the coordinator also persists a high-water mark in
the run directory, ahead of use: before it hands out a number above the mark it writes a new mark
``RESERVE_US`` further on (one small fsynced write a minute), and a restarted coordinator starts above the mark.
Each number is max(clock, last + 1): monotonic whatever the clock does.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

RESERVE_US = 60_000_000
"""How far ahead of the number in use the persisted mark is written (µs of clock: one write a minute)."""

FILE = "order_seq"


def wall_us() -> int:
    return time.time_ns() // 1000


class OrderSequence:
    def __init__(self, directory: str | None = None):
        """``directory``: where the mark lives (the run directory); None: not persisted (tests, the lab)."""
        self.path = os.path.join(directory, FILE) if directory else None
        self.last = self.reserved = self._read()

    def next(self) -> int:
        """A number above every one this run's coordinators handed out before."""
        self.last = max(wall_us(), self.last + 1)
        if self.path is not None and self.last > self.reserved:
            self._write(self.last + RESERVE_US)
        return self.last

    def _read(self) -> int:
        if self.path is None or not os.path.exists(self.path):
            return 0
        try:
            with open(self.path) as f:
                return int(f.read().strip())
        except ValueError:  # a torn write of a crashed machine: the clock is all there is to go on
            log.error("%s is unreadable: order numbers start from the clock", self.path)
            return 0

    def _write(self, mark: int) -> None:
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{mark}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk: orders go on, only a restart after a clock step could now collide
            log.error("cannot persist the order sequence to %s (%s); orders go on from the clock", self.path, e)
            return
        self.reserved = mark
