"""Deadlines and per-worker shares: the policy that keeps one stuck or hostile worker from stopping a run.

Pure numbers in, decisions out (no sockets, no threads); the coordinator holds the state and applies them.

* **Deadline.** A pull hands a worker k groups on top of the h it already holds; at its measured rate of
  μ rollouts/s it needs about (h + k)·G / μ seconds for all of them. The new groups are due after
  ``slack`` times that, clamped to [floor_s, cap_s]; a worker that has not yet reported a rate gets cap_s
  (its first batch includes engine warm-up). Past the deadline a group is lost (``lost: deadline``) and its
  prompt re-queued for any worker; a late result for it is refused as not in flight.
* **Share.** A worker may hold at most ``share`` of the in-flight cap ((S+1)·P groups), so a worker that sits
  on its groups can delay the learner by at most that share until their deadline passes.
* **Strikes.** Each reaper pass in which a worker had groups expire is a miss; each miss halves its share, an
  on-time push gives one back, and at ``strikes`` misses it gets no more work for the rest of the run
  (benched: it stays registered, so it cannot re-join as a fresh worker by being forgotten).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    floor_s: float = 10.0  # no deadline shorter than this (network round trips, a slow first token)
    cap_s: float = 600.0  # no deadline longer than this; also the deadline of a worker with no measured rate
    slack: float = 4.0  # multiple of the expected generation time a worker is given
    share: float = 0.5  # most of the in-flight cap one worker may hold, in (0, 1]
    strikes: int = 3  # misses after which a worker gets no more work

    def __post_init__(self):
        if not 0 < self.floor_s <= self.cap_s:
            raise ValueError(f"deadline floor_s={self.floor_s}, cap_s={self.cap_s}: need 0 < floor_s <= cap_s")
        if not self.slack >= 1:
            raise ValueError(f"deadline slack={self.slack}: need >= 1")
        if not 0 < self.share <= 1:
            raise ValueError(f"worker share={self.share}: need 0 < share <= 1")
        if self.strikes < 1:
            raise ValueError(f"deadline strikes={self.strikes}: need >= 1")

    def deadline_s(self, rollouts_per_s: float, groups_held: int, group_size: int) -> float:
        """Seconds a worker that will hold ``groups_held`` groups (new ones included) gets for the new ones."""
        if not rollouts_per_s > 0:
            return self.cap_s
        expected_s = groups_held * group_size / rollouts_per_s
        return min(self.cap_s, max(self.floor_s, self.slack * expected_s))

    def worker_limit(self, cap_groups: int, misses: int) -> int:
        """Most groups a worker with ``misses`` misses may hold in flight, out of ``cap_groups`` for all."""
        if misses >= self.strikes:
            return 0
        return max(1, math.floor(self.share * cap_groups / 2**misses))

    def benched(self, misses: int) -> bool:
        return misses >= self.strikes
