"""Who pulls a snapshot from whom: pure planning, no sockets (docs/design.md §2).

    chain:  origin → p1 → p2 → ... → pN        every link carries each byte once; time ≈ M/B + N·(latency + piece)
    tree:   origin → p1 → {p2, p3}, p2 → {p4, p5}, ...   (binary heap order with ``fanout`` children per node)
    star:   origin → every peer                 one-to-many: the origin's uplink carries N·M (the baseline)

Peers are placed fastest first (measured download rate, rates within 10 % counting as equal; then lower
measured RTT, the kernel's smoothed estimate on the peer's connection to its source): in a tree an inner node
uploads to ``fanout`` children, so the best-connected peers belong near the root; in a chain the slowest link bounds the
rate wherever it sits, but putting slow peers last keeps their stalls from delaying the others' bytes.
Each peer's source list is its ancestors, nearest first; the origin is always the last resort, so a dead or
stalled relay is routed around by moving one step up the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("chain", "tree", "star")


RATE_TIE = 1.1  # download rates within this factor are the same link class: then the lower RTT goes first


@dataclass(frozen=True)
class PeerLink:
    peer_id: str
    rate_bytes_per_s: float = 0.0  # measured in earlier broadcasts; 0 = unknown (placed last)
    rtt_s: float = 0.0  # measured in earlier broadcasts (TCP's smoothed RTT to its source); 0 = unknown


def order(peers: list[PeerLink]) -> list[PeerLink]:
    """Fastest first; within a rate class (RATE_TIE: measured rates are never exactly equal, and a chain's peers
    all measure its bottleneck), nearest first, since each hop adds its latency to everyone after it."""
    def rate_class(p: PeerLink) -> float:
        return -math.floor(math.log(p.rate_bytes_per_s, RATE_TIE)) if p.rate_bytes_per_s > 0 else math.inf

    return sorted(peers, key=lambda p: (rate_class(p), p.rtt_s, p.peer_id))


def plan(peers: list[PeerLink], kind: str = "chain", fanout: int = 2) -> dict[str, list[str]]:
    """For every peer, the peers it should pull from, nearest ancestor first (the origin is implied after them)."""
    if kind not in KINDS:
        raise ValueError(f"topology {kind!r}: expected one of {KINDS}")
    if fanout < 1:
        raise ValueError(f"fanout={fanout}: must be >= 1")
    ranked = [p.peer_id for p in order(peers)]
    parent: dict[int, int | None] = {}
    for i in range(len(ranked)):
        if kind == "star" or i == 0:
            parent[i] = None
        elif kind == "chain":
            parent[i] = i - 1
        else:
            parent[i] = (i - 1) // fanout
    out = {}
    for i, pid in enumerate(ranked):
        ancestors, j = [], parent[i]
        while j is not None:
            ancestors.append(ranked[j])
            j = parent[j]
        out[pid] = ancestors
    return out


def depth(sources: dict[str, list[str]]) -> int:
    """Hops from the origin to the deepest peer."""
    return 1 + max((len(a) for a in sources.values()), default=-1)
