"""What the online planner is built from: its typed settings (conf/activation) and the broadcast's shape.

``ActivationSettings`` is also the Hydra schema of the ``activation`` config group (echo2/config.py registers
it), so the YAML, the type check at compose time and the planner read one definition; each key's meaning and
units are in conf/activation/default.yaml. ``BroadcastShape`` carries the broadcast group's settings that change
the dissemination time (conf/broadcast): the relay's own topology names, its fan-out and the publish interval κ.
Pure: no Hydra, sockets or threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from echo2.broadcast.topology import FANOUT

T = TypeVar("T")


@dataclass
class ActivationSettings:
    solver: str = "all_on"
    learner_usd_per_hour: float = 0.0
    learner_uplink_mbit: float = 1000.0
    min_utilization: float = 0.0
    hysteresis: float = 0.1
    replan_every_s: float = 30.0
    load_s: float = 0.0
    on_change: Optional[str] = None


@dataclass(frozen=True)
class BroadcastShape:
    """How snapshots travel, as the capacity model needs it. Defaults: RelayBroadcaster's."""

    topology: str = "auto"  # auto, chain, tree, stripes or star (broadcast.sender.topology)
    fanout: int = FANOUT  # children per relaying peer in a tree, stripes (broadcast.sender.fanout)
    interval: int = 1  # κ: a snapshot every this many learner steps (broadcast.interval)

    @classmethod
    def of(cls, broadcast: Any) -> BroadcastShape:
        """From the broadcast config group (a mapping with ``interval`` and ``sender``); a sender without a
        ``topology`` or ``fanout`` key gets the broadcaster's default."""
        sender = broadcast["sender"]
        return cls(topology=sender.get("topology", cls.topology), fanout=int(sender.get("fanout", cls.fanout)),
                   interval=int(broadcast["interval"]))


def detached(cls: type[T], value: Any) -> T | None:
    """``value`` as a plain ``cls`` instance: Hydra hands a dataclass passed to ``instantiate`` on as a config node
    tied to its whole tree (which may not pickle); this rebuilds it from its fields. None stays None."""
    return value if value is None or isinstance(value, cls) else cls(**value)
