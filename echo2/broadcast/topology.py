"""Who pulls a snapshot from whom: pure planning, no sockets (docs/design.md §2).

    chain:  origin → p1 → p2 → ... → pN        every link carries each byte once; time ≈ M/B + N·(latency + piece)
    tree:   origin → p1 → {p2, p3}, p2 → {p4, p5}, ...   (binary heap order with ``fanout`` children per node)
    star:   origin → every peer                 one-to-many: the origin's uplink carries N·M (the baseline)

Peers are placed fastest first (download rate, rates within 10 % counting as equal; then lower RTT, by the
millisecond; then by id): in a tree an
inner node uploads to ``fanout`` children, so the best-connected peers belong near the root; in a chain the slowest
link bounds the rate wherever it sits, but putting slow peers last keeps their stalls from delaying the others'
bytes. Both numbers are the learner's measurements (broadcaster.py), never a peer's report of itself: a peer that
claimed a fast link would otherwise take the head of the chain, and every byte would pass through it. A peer
with no measurement (new, or its last transfer failed) goes last, where it can do least harm: no successor in a
chain, none but leaves in a tree.
Each peer's source list is its ancestors, nearest first; the origin is always the last resort, so a dead or
stalled relay is routed around by moving one step up the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("chain", "tree", "star")


RTT_TIE_S = 1e-3  # round-trip times in the same millisecond are the same distance: no reordering on noise
RATE_TIE = 1.1  # download rates within this factor are the same link class: then the lower RTT goes first


@dataclass(frozen=True)
class PeerLink:
    peer_id: str
    rate_bytes_per_s: float = 0.0  # measured by the learner in earlier broadcasts; 0 = unknown (placed last)
    rtt_s: float = 0.0  # measured by the learner (its quickest answer to a small request); 0 = unknown (last)


def order(peers: list[PeerLink]) -> list[PeerLink]:
    """Fastest first; within a rate class (RATE_TIE: measured rates are never exactly equal, and a chain's peers
    all measure its bottleneck), nearest first, since each hop adds its latency to everyone after it."""
    def rate_class(p: PeerLink) -> float:
        return -math.floor(math.log(p.rate_bytes_per_s, RATE_TIE)) if p.rate_bytes_per_s > 0 else math.inf

    def rtt_class(p: PeerLink) -> float:
        return math.floor(p.rtt_s / RTT_TIE_S) if p.rtt_s > 0 else math.inf

    return sorted(peers, key=lambda p: (rate_class(p), rtt_class(p), p.peer_id))


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
