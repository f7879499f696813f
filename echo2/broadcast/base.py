"""The seam between the learner and weight dissemination."""

from __future__ import annotations

from typing import Any, Protocol


class Broadcaster(Protocol):
    on_delivered: Any
    """Set by the coordinator: ``on_delivered(peer_id, version)`` after a worker holds a verified snapshot,
    so a worker long-polling with an old version is told at once to apply it."""

    def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        """Called by the learner every κ steps with the new weights; returns at once (the send runs in the
        background; a newer snapshot supersedes one not yet sent)."""
        ...

    def add_peer(self, peer_id: str, url: str) -> None:
        """Called when a worker registers; a late joiner is sent the latest snapshot."""
        ...

    def remove_peer(self, peer_id: str) -> None:
        """Called when a worker leaves or is declared dead."""
        ...

    def metrics(self) -> dict[str, float]:
        """``broadcast/*`` counters, read once per learner step."""
        ...

    def close(self) -> None: ...
