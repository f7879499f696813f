"""What one request, and one credential, may cost the coordinator: body sizes per route, and registrations per
credential over time. Pure numbers in, decisions out; the coordinator applies them (its JsonServer's
``route_max_bytes``, and ``Registrations.allow`` in ``/register``).

* **Bodies.** A body is refused on its declared length, before a byte is read (net.http.JsonServer), so each route's
  limit is what its largest honest body can be: a push carries at most the in-flight cap's groups ((S+1)·P: no
  worker may hold more), each G completions of at most ``max_tokens`` tokens, each token an id and a logprob as JSON
  writes them (``BYTES_PER_TOKEN``, half again over the longest form: ``"151935, -1.2345678901234567e-05, "``); a
  release names at most that many group ids; every other body is a few fields (``SMALL_BYTES``). A stranger with a
  credential can then make the coordinator read and parse no more than one honest push at a time per connection, and
  no more than two of the largest at a time over all its connections (``principal_body_bytes``).
* **Registrations.** Each ``/register`` costs a worker id, a journal line and a place in the books; a credential
  that registers and leaves in a loop would grow them without bound. Each worker credential has a token bucket:
  ``REGISTER_BURST`` at once (a SLURM array starting together), then one every ``REGISTER_EVERY_S``. The run secret
  (the learner's own agents) is not limited.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2.coordinator.schemas import MAX_GROUPS_PER_REQUEST, MAX_ID_CHARS

BYTES_PER_TOKEN = 48
"""One token of a pushed completion as JSON: its id (up to 7 characters with the separator) and its logprob (up to
25: ``-1.2345678901234567e-05, ``), 33 at most, with half again for headroom."""
COMPLETION_BYTES = 256
"""A completion's keys and finish reason around its two lists (~64 bytes written out), with headroom."""
GROUP_BYTES = 256
"""A result's group id, version and keys around its completions (~70 bytes), with headroom."""
SMALL_BYTES = 4 << 10
"""Every other body: a few ids, numbers and short strings (a registration's longest is ~2 KiB of model name, digest
and addresses, each at most schemas.MAX_TEXT_CHARS)."""
REGISTER_BYTES = 8 << 10
REGISTER_BURST = 32
"""Registrations one worker credential may make at once: twice the ids it may hold (coordinator
.MAX_IDS_PER_CREDENTIAL), so a whole box or array of them re-joining after a coordinator restart is never refused."""
REGISTER_EVERY_S = 10.0
"""Past the burst, one registration per this many seconds: an agent that crashes and restarts re-joins in far less
than its engine takes to load again."""


def body_limits(staleness: int, prompts_per_step: int, group_size: int, max_tokens: int,
                eval_rows: int = 0) -> dict[str, int]:
    """Most body bytes per coordinator route (the rest: SMALL_BYTES), for a run of staleness S, P prompts per step,
    G completions per group and at most ``max_tokens`` tokens per completion; ``eval_rows``: held-out rows a worker
    evaluates (run.eval_on=workers; 0: no evaluation route), one completion each."""
    groups = min(MAX_GROUPS_PER_REQUEST, (staleness + 1) * prompts_per_step)
    group_bytes = GROUP_BYTES + group_size * (COMPLETION_BYTES + max_tokens * BYTES_PER_TOKEN)
    row_bytes = GROUP_BYTES + COMPLETION_BYTES + max_tokens * BYTES_PER_TOKEN
    return {"POST /push": SMALL_BYTES + groups * group_bytes,
            "POST /release": SMALL_BYTES + groups * (MAX_ID_CHARS + 4),
            "POST /register": REGISTER_BYTES,
            **({"POST /eval": SMALL_BYTES + eval_rows * row_bytes} if eval_rows else {})}


def principal_body_bytes(route_limits: dict[str, int]) -> int:
    """The most body bytes one worker credential's requests may hold at once (http.JsonServer): two of the largest
    bodies a route takes. Every honest push carries what its own worker holds, a share of the run's in-flight cap
    that the push limit is sized for whole, so a credential's workers together stay below one limit; without this
    bound one credential's 64 connections could each declare the largest body (a 4B-model run's push limit is ~38 MB)
    and have the coordinator hold all of them at once."""
    return 2 * max([SMALL_BYTES, REGISTER_BYTES, *route_limits.values()])


@dataclass
class Registrations:
    """A token bucket per worker credential (module doc). ``allow(name, now)`` takes a token or says no."""

    burst: int = REGISTER_BURST
    every_s: float = REGISTER_EVERY_S
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (tokens, at: monotonic s)

    def allow(self, name: str, now: float) -> bool:
        tokens, at = self.buckets.get(name, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) / self.every_s)
        if tokens < 1.0:
            self.buckets[name] = (tokens, now)
            return False
        self.buckets[name] = (tokens - 1.0, now)
        return True

    def wait_s(self, name: str, now: float) -> float:
        """Seconds until ``name`` may register again (0: now)."""
        tokens, at = self.buckets.get(name, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) / self.every_s)
        return max(0.0, (1.0 - tokens) * self.every_s)
