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

from echo2.settings import LivenessSettings


class Liveness(LivenessSettings):
    """The policy's decisions for the settings' values (checked by LivenessSettings)."""

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
