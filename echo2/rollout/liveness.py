"""Deadlines, shares and strikes: the policy that keeps one stuck or hostile credential from stopping a run.

Pure numbers in, decisions out (no sockets, no threads); the coordinator holds the state and applies them. What
is judged is a *principal* (registry.py): one worker credential, however many worker ids it registers (a
worker registered with the run secret is its own principal).

* **Deadline.** A pull hands a worker k groups on top of the h it already holds; at its rate of μ rollouts/s it
  needs about (h + k)·G / μ seconds for all of them. The new groups are due after ``slack`` times that,
  clamped to [floor_s, cap_s]. μ is measured by the coordinator from the worker's valid pushes (never its own
  claim); a worker with none yet is given the slowest measured rate among the live workers (so a newcomer as
  fast as the slowest of them makes it), and cap_s only while no worker has a measured rate (the run's first
  batches, engine warm-up included). Past the deadline a group is lost (``lost: deadline``) and its prompt
  re-queued for any worker; a late result for it is refused (``past_deadline``).
* **Share.** A principal may hold at most max(``share``, 1/n) of the in-flight cap ((S+1)·P groups), n the
  principals that can get work now: a principal that sits on its groups delays the learner by at most that
  until their deadline, while one or two honest workers alone can still fill the whole cap (one vLLM worker
  held to half the cap left the learner waiting 26% of the time in a held-out run at S = 2). A principal with
  no valid push yet holds at most one pull's worth (``groups_per_pull``): a credential that never delivers
  costs little.
* **Strikes.** Each reaper pass in which a principal had groups expire is a miss, and so is each push with an
  invalid result (ill-formed, for a group never in flight for it, from a version it was never delivered or from
  the future, or whose reward hung or crashed: intake.STRIKES); each miss halves its share, a push of only
  valid results gives one back, and at ``strikes`` misses it gets no more work for the rest of the run
  (benched: registering again is refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    floor_s: float = 10.0  # no deadline shorter than this (network round trips, a slow first token)
    cap_s: float = 600.0  # no deadline longer than this; also every deadline while no worker has a measured rate
    slack: float = 4.0  # multiple of the expected generation time a worker is given
    share: float = 0.5  # most of the in-flight cap one principal may hold (while > 1/share can get work), in (0, 1]
    strikes: int = 3  # misses after which a principal gets no more work

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
        """Seconds a worker that will hold ``groups_held`` groups (new ones included) gets for the new ones, at
        ``rollouts_per_s`` (its measured rate, or the fresh-worker rate of the module doc; 0: cap_s)."""
        if not rollouts_per_s > 0:
            return self.cap_s
        expected_s = groups_held * group_size / rollouts_per_s
        return min(self.cap_s, max(self.floor_s, self.slack * expected_s))

    def worker_limit(self, cap_groups: int, misses: int, principals: int = 0) -> int:
        """Most groups a principal with ``misses`` misses may hold in flight, out of ``cap_groups`` for all, while
        ``principals`` principals (itself included; 0: unknown, many) can get work."""
        if misses >= self.strikes:
            return 0
        share = max(self.share, 1 / principals) if principals > 0 else self.share
        return max(1, math.floor(share * cap_groups / 2**misses))

    def crowd(self) -> int:
        """Principals beyond which the share no longer grows: counting further changes nothing."""
        return math.ceil(1 / self.share)

    def benched(self, misses: int) -> bool:
        return misses >= self.strikes
