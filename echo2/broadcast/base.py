"""The seam between the learner and weight dissemination.

A broadcaster lives in the coordinator's process (echo2/rollout/service.py): train.py hands the rollout source
a factory (Hydra ``_partial_``), called there.
"""

from __future__ import annotations

from typing import Any, Protocol


class Broadcaster(Protocol):
    on_delivered: Any
    """Set by the coordinator: ``on_delivered(peer_id, version)`` after a worker holds a verified snapshot,
    so a worker long-polling with an old version is told at once to apply it."""

    on_ordered: Any
    """Set by the coordinator: ``on_ordered(peer_id, version)`` before a worker is told to fetch a snapshot: it may
    hold, apply and claim it before the answer proving delivery comes back: such a claim costs it no strike."""

    epoch: str | None
    """Set by the coordinator before the first publish: the learner process's epoch, signed into every manifest and
    order (a worker takes nothing of an older epoch)."""

    def publish(self, version: int, blob: bytes, probe: dict | None = None) -> None:
        """Called every κ learner steps with the new weights as snapshot bytes (``snapshot.encode``) and the
        learner's probe logprobs of them (for the workers' check); returns at once (the send runs in the
        background; a newer snapshot supersedes one not yet sent)."""
        ...

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None) -> None:
        """Called when a worker registers (its control URL and relay node address); a late joiner is sent the
        latest snapshot."""
        ...

    def remove_peer(self, peer_id: str) -> None:
        """Called when a worker leaves or is declared dead."""
        ...

    def rekey(self) -> None:
        """Called when a worker credential is revoked, after its workers were removed: from then on they can neither
        fetch from nor serve the live workers."""
        ...

    def metrics(self) -> dict[str, float]:
        """``broadcast/*`` counters, read once per learner step."""
        ...

    def close(self) -> None: ...
