"""Settings that cross from the learner's process into the coordinator's: frozen, checked where they are built.

The learner builds them from ``rollout.source`` (so that a bad value fails there, before any process starts) and
the coordinator process is handed them whole; their meaning is in echo2/coordinator/liveness.py and trust.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LivenessSettings:
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


@dataclass(frozen=True)
class CheckSettings:
    """The rollout checks' thresholds (echo2/coordinator/trust.py)."""

    max_abs_log_ratio: float = 2.0  # b: mean |log-ratio| per token an honest worker stays under, in nats
    evidence_nats: float = 12.0  # E: CUSUM of excess nats at which a principal is retired (E/4: flagged)

    def __post_init__(self):
        if not self.max_abs_log_ratio > 0 or not self.evidence_nats > 0:
            raise ValueError(f"rollout checks: max_abs_log_ratio={self.max_abs_log_ratio} and evidence_nats="
                             f"{self.evidence_nats} must be > 0")
