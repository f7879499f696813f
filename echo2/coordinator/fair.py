"""Fair order for the reward pool: which queued group a free reward process scores next, and what each principal is
charged for it. Pure: no processes, threads or clocks (the pool passes times in).

    push A (principal x): a1 a2 a3 ─┐
    push B (principal x): b1 b2     ├─► FairQueue.pop() ─► the principal with the fewest groups being scored now,
    push C (principal y): c1       ─┘     then the least charged, then the one waiting longest; within it, its
                                          pushes in turn (a1 b1 a2 b2 a3), each push's groups in order

A principal (a worker credential; each of the run secret's workers is its own) is charged the seconds its groups
held a reward process, decayed with a half-life of ``half_life_s``: one that sends groups slow to score (math-verify
on a crafted answer takes seconds and then scores 0) goes behind everyone else for as long as it keeps doing it,
and honest groups, quick to score, go first. Nobody is starved: a waiting principal's charge only decays, so it gets
its turn. And no principal has more than ``max_busy`` groups scored at once (the pool gives half its processes):
otherwise one that is alone for a moment takes every process with groups that each hold one for seconds, and the
next honest push waits that long whatever the order (measured in the hostile soak: the learner idled 8-13 s a step).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

HALF_LIFE_S = 60.0
"""How long a principal's scoring time counts against it, as a half-life: long enough that a slow sender stays behind
for the minutes it keeps sending, short enough that an honest worker's one slow group is forgotten soon."""


@dataclass
class _Principal:
    pushes: deque = field(default_factory=deque)  # of deques of jobs, taken in turn
    charge_s: float = 0.0  # decayed scoring seconds, as of ``charged_at``
    charged_at: float = 0.0
    waiting_since: float = math.inf  # turn number since which it has been waiting (lower: longer)


class FairQueue:
    def __init__(self, half_life_s: float = HALF_LIFE_S, max_busy: int | None = None):
        """``max_busy``: most groups of one principal being scored at once (None: no limit)."""
        self.half_life_s, self.max_busy = half_life_s, max_busy
        self.principals: dict[str, _Principal] = {}
        self.busy: Counter = Counter()  # principal -> its groups being scored now
        self.queued = 0
        self.turn = 0  # counts pushes and pops: who has waited longest, without a clock's ties

    def push(self, principal: str, jobs: list[Any], now: float) -> None:
        """Queue one push's jobs (its groups, in order) for ``principal``."""
        if not jobs:
            return
        p = self.principals.setdefault(principal, _Principal(charged_at=now))
        self.turn += 1
        if not p.pushes:
            p.waiting_since = self.turn
        p.pushes.append(deque(jobs))
        self.queued += len(jobs)

    def ready(self) -> bool:
        """Whether a job may be popped now (one waits, of a principal below ``max_busy``)."""
        return any(p.pushes and self._may(k) for k, p in self.principals.items())

    def _may(self, key: str) -> bool:
        return self.max_busy is None or self.busy[key] < self.max_busy

    def pop(self, now: float) -> tuple[str, Any] | None:
        """The next (principal, job) to score, counted as being scored until ``done``; None if nothing may be."""
        waiting = [k for k, p in self.principals.items() if p.pushes and self._may(k)]
        if not waiting:
            return None
        key = min(waiting, key=lambda k: (self.busy[k], self.charge(k, now), self.principals[k].waiting_since))
        p = self.principals[key]
        push = p.pushes.popleft()
        job = push.popleft()
        if push:
            p.pushes.append(push)  # its next group waits for the principal's other pushes' turn
        self.turn += 1
        p.waiting_since = self.turn if p.pushes else math.inf  # back of the line
        self.queued -= 1
        self.busy[key] += 1
        return key, job

    def done(self, principal: str, seconds: float, now: float) -> None:
        """A job of ``principal`` popped earlier took ``seconds`` of a reward process: charge it."""
        self.busy[principal] -= 1
        if self.busy[principal] <= 0:
            del self.busy[principal]
        p = self.principals.get(principal)
        if p is None:
            return
        p.charge_s = self.charge(principal, now) + max(0.0, seconds)
        p.charged_at = now
        self._forget(now)

    def remove(self, job: Any) -> bool:
        """Take a queued ``job`` out (its push gave up waiting); whether it was queued."""
        for key, p in self.principals.items():
            for push in p.pushes:
                if job in push:
                    push.remove(job)
                    self.queued -= 1
                    if not push:
                        p.pushes.remove(push)
                    if not p.pushes:
                        p.waiting_since = math.inf
                    return True
        return False

    def charge(self, principal: str, now: float) -> float:
        """``principal``'s decayed scoring seconds at ``now``."""
        p = self.principals.get(principal)
        if p is None:
            return 0.0
        return p.charge_s * 0.5 ** (max(0.0, now - p.charged_at) / self.half_life_s)

    def _forget(self, now: float) -> None:
        """Drop the principals with nothing queued or being scored whose charge has decayed to nothing, so that the
        table holds those of the last minutes, not every one ever seen."""
        for key in [k for k, p in self.principals.items()
                    if not p.pushes and not self.busy[k] and self.charge(k, now) < 1e-3]:
            del self.principals[key]
