"""Whose fault a reward's failure is: a worker is struck only for what its own output caused.

A group whose reward hangs past the pool's limit or kills its process (``reward_timeout``, ``reward_crashed``) may be
the sender's doing (a crafted answer that sends sympy into a loop) or the reward's own (a verifier that is down, a C
extension that crashes on anything, a machine out of memory). Striking every such failure benched every honest
worker of a run whose verifier broke. So a failure makes its principal a *suspect*, and the verdict waits for the
next group scored:

    failure from x, then a group of another principal scored fine     ─► x's output caused it: one strike for x
    failure from x, then a failure from another principal y            ─► the reward fails for everyone: no strike,
                                                                          and every suspect is cleared
    failure from x, then more of x's own                               ─► still a suspect (its own successes prove
                                                                          nothing about its failures)

Why this rule and not a re-score of the same group by another worker: a failing group's prompt is not re-queued (it
may fail again), and a re-score costs a worker's generation; the next groups from others are scored anyway, and
they say whether the reward works. What it does not catch: two credentials of one attacker failing in turn clear
each other (the pool's fair order still charges them the time, fair.py); a lone worker is never struck for a
failure, since nothing can tell its output from the reward. Pure policy, no clock: intake.settle feeds it each
scored or failed group, in the order pushes settle, and strikes whom it names.
"""

from __future__ import annotations

FAULTS = frozenset({"reward_timeout", "reward_crashed"})
"""Outcomes that may be the sender's fault (a reward that raises, ``reward_error``, is the task's: never struck)."""


class RewardFaults:
    def __init__(self) -> None:
        self.suspects: dict[str, int] = {}  # principal -> its failures awaiting a verdict
        self.cleared = 0  # failures found to be the reward's own (several principals failing with no success between)

    def observe(self, principal: str, reason: str | None) -> list[str]:
        """One group of ``principal`` scored (``reason`` None) or failed (its reason). Returns the principals whose
        failures this proves were their own doing (one strike each)."""
        if reason in FAULTS:
            if any(p != principal for p in self.suspects):  # another sender failed too, with no success between
                self.cleared += sum(self.suspects.values()) + 1
                self.suspects.clear()
                return []
            self.suspects[principal] = self.suspects.get(principal, 0) + 1
            return []
        if reason is not None:  # neither a success nor a fault of the sender's (reward_error, reward_unavailable)
            return []
        proven = sorted(p for p in self.suspects if p != principal)
        for p in proven:
            del self.suspects[p]
        return proven
