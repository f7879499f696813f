"""Who pulls a snapshot from whom, and which layout to use: pure planning, no sockets (docs/design.md §2).

    chain:    origin → p1 → p2 → ... → pN        every link carries each byte once; time ≈ M/B + N·(ℓ + piece/B)
    tree:     origin → p1 → {p2, p3}, p2 → {p4, p5}, ...   (heap order, ``fanout`` children per node): depth
              log_f N, but an inner node uploads every byte f times, so time ≈ f·M/B
    stripes:  the snapshot cut into s byte ranges (stripes), each streamed down its own heap tree of fanout s;
              every peer is an inner node of one stripe's tree only (SplitStream, Castro et al. 2003), so it
              uploads s copies of 1/s of the bytes: M, once, as in a chain, and downloads its s stripes from s
              different parents at B/s each; time ≈ M/B + depth·(ℓ + s·piece/B), depth ≈ log_s N
    star:     origin → every peer                 one-to-many: the origin's uplink carries N·M (the baseline)
    auto:     chain or stripes, whichever ``choose`` predicts faster for this round's N, RTT, rate and size

Why stripes. A chain adds a hop's latency per peer: at N = 64 and a 20 ms RTT that is ~0.6 s on a 1.6 s
transfer (200 MB at 1 Gbit/s). Mundinger, Weber and Weiss (2008) show the optimum for k equal chunks over equal
links is (M/B)(1 + ⌊log₂N⌋/k): the added term can grow with log N, not N, while every peer still uploads each
byte once; their optimal schedule is a pipelined binomial tree, which needs every peer to switch partners chunk
by chunk. Stripes get the same log N with long-lived streams the relay already has (one TCP connection per
parent, cut-through forwarding, failover up each stripe's own tree), at the price of s connections per peer
and parents that share their uplink between s children.

Peers are placed fastest first (download rate, rates within 10 % counting as equal; then lower RTT, by the
millisecond; then by id): in a tree an inner node uploads to ``fanout`` children, so the best-connected peers belong
near the root; in a chain the slowest link bounds the rate wherever it sits, but putting slow peers last keeps their
stalls from delaying the others' bytes. Both numbers are the learner's measurements
(echo2/coordinator/broadcaster.py), never a peer's report of itself: a peer that claimed a fast link would otherwise
take the head of the chain, and every byte would pass through it. A peer with no measurement (new, or its last
transfer failed) goes last, where it can do least harm: no successor in a chain, none but leaves in a tree or a
stripe's tree. Each peer's source list is its ancestors, nearest first (per stripe, in that stripe's tree); the
origin is always the last resort, so a dead or stalled relay is routed around by moving one step up the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("auto", "chain", "tree", "stripes", "star")
FANOUT = 2
"""The default fan-out: children per relaying peer in a tree, the most stripes for ``stripes``
(broadcast.sender.fanout; every default of it reads this one)."""

RTT_TIE_S = 1e-3  # round-trip times in the same millisecond are the same distance: no reordering on noise
RATE_TIE = 1.1  # download rates within this factor are the same link class: then the lower RTT goes first

PIECE_BYTES = 256 << 10
"""framing.PIECE_BYTES (not imported: this module stays free of the relay's code): the most a relay node sends in
one call, so the most a byte can wait at a hop before it is forwarded."""

MAX_STRIPES = 4
"""Most stripes ``choose`` considers: each is a connection into and out of every peer and a thread at each end,
and a parent's uplink shared s ways makes each hop wait s pieces; past 4 the depth (log_s N) shrinks by a hop or
two at most, up to N = 1000."""

STRIPES_TIE = 0.02
"""Among stripe counts, the fewest whose predicted added time is within this fraction of M/B (or 10 ms, whichever
is more) of the best: more stripes mean more connections and more uplinks shared unevenly."""

MIN_STRIPE_BYTES = 64 << 10
"""A stripe carries at least this many bytes: below that it is a handful of packets, and its connection costs more
than it saves (a tiny delta goes by chain). A small object gains from stripes as much as a large one: a chain's
hops cost latency whatever the size."""

FORWARD_S = 3e-3
"""What a byte waits at a hop before it goes on, per stream sharing the sender's uplink, at most piece/B: a link
delivers a piece packet by packet and the relay forwards what each read returns, so the wait is far below a
whole piece's time; a parent serving s children sends each its share in turn. Measured on the in-process bench
(echo2/lab/link.py, 20 Mbit/s, 20 ms RTT, 2 shared cores): a chain hop ℓ + 1 ms, a 2-stripe hop ℓ + 7 ms."""

STRIPES_MIN_GAIN = 0.05
"""``auto`` stripes a round only if that is predicted to save at least this fraction of the transfer time M/B
(and STRIPES_MIN_GAIN_S): s connections per peer and shared uplinks cost something the model does not see (TCP
flows sharing a queue unevenly), so where the chain is about as good it is kept."""

STRIPES_MIN_GAIN_S = 0.05
"""The least absolute saving (s) for ``auto`` to stripe, also when the rate is not measured yet (M/B unknown)."""


@dataclass(frozen=True)
class PeerLink:
    peer_id: str
    rate_bytes_per_s: float = 0.0  # measured by the learner in earlier broadcasts; 0 = unknown (placed last)
    rtt_s: float = 0.0  # measured by the learner (its quickest answer to a small request); 0 = unknown (last)


@dataclass(frozen=True)
class Layout:
    """A round's shape: ``kind`` (chain, tree, stripes, star) and its ``fanout`` (tree: children per node;
    stripes: the number of stripes, which is also each stripe tree's fanout)."""

    kind: str
    fanout: int = 1

    @property
    def stripes(self) -> int:
        return self.fanout if self.kind == "stripes" else 1


def order(peers: list[PeerLink]) -> list[PeerLink]:
    """Fastest first; within a rate class (RATE_TIE: measured rates are never exactly equal, and a chain's peers
    all measure its bottleneck), nearest first, since each hop adds its latency to everyone after it."""
    def rate_class(p: PeerLink) -> float:
        return -math.floor(math.log(p.rate_bytes_per_s, RATE_TIE)) if p.rate_bytes_per_s > 0 else math.inf

    def rtt_class(p: PeerLink) -> float:
        return math.floor(p.rtt_s / RTT_TIE_S) if p.rtt_s > 0 else math.inf

    return sorted(peers, key=lambda p: (rate_class(p), rtt_class(p), p.peer_id))


def plan(peers: list[PeerLink], kind: str = "chain", fanout: int = FANOUT) -> dict[str, list[str]]:
    """For every peer, the peers it should pull from, nearest ancestor first (the origin is implied after them).
    One tree: chain, tree or star (stripes: ``plan_stripes``)."""
    if kind not in ("chain", "tree", "star"):
        raise ValueError(f"topology {kind!r}: expected chain, tree or star")
    if fanout < 1:
        raise ValueError(f"fanout={fanout}: must be >= 1")
    ranked = [p.peer_id for p in order(peers)]
    if kind == "star":
        return {pid: [] for pid in ranked}
    return _heap(ranked, 1 if kind == "chain" else fanout)


def _heap(ranked: list[str], fanout: int) -> dict[str, list[str]]:
    """Ancestors (nearest first) of each peer of ``ranked`` laid out as a heap: position i's parent is
    (i − 1) // fanout (a chain is the heap of fanout 1)."""
    out: dict[str, list[str]] = {}
    for i, pid in enumerate(ranked):
        ancestors, j = [], i
        while j > 0:
            j = (j - 1) // fanout
            ancestors.append(ranked[j])
        out[pid] = ancestors
    return out


def plan_stripes(peers: list[PeerLink], stripes: int) -> dict[str, list[list[str]]]:
    """For every peer, per stripe, the peers it pulls that stripe from, nearest ancestor first.

    Stripe j's tree is a heap of fanout ``stripes`` over group j (every ``stripes``-th peer of the ranked order,
    from the j-th: each group holds fast and slow peers alike) followed by everyone else in rank order. A heap of
    N nodes has ⌈(N − 1)/s⌉ inner positions, which group j fills alone when N mod s ≤ 1 (``stripes_fit``): then
    every peer is an inner node of one tree only, and uploads s · M/s = M. Otherwise some peers of other groups
    also fill inner positions, and upload up to (1 + 1/s)·M.

    Peers without a measured rate (new, or planned last after a failure) are not in any group: they close every
    tree, so none of them is an ancestor of a measured peer in any stripe (as in a chain, where they go last);
    when no peer is measured yet (the first round), all of them make the groups."""
    if stripes < 1:
        raise ValueError(f"stripes={stripes}: must be >= 1")
    ranked = order(peers)
    known = [p.peer_id for p in ranked if p.rate_bytes_per_s > 0]
    unknown = [p.peer_id for p in ranked if p.rate_bytes_per_s <= 0]
    grouped, tail = (known, unknown) if known else (unknown, [])
    out: dict[str, list[list[str]]] = {p.peer_id: [] for p in ranked}
    for j in range(stripes):
        group = grouped[j::stripes]
        members = set(group)
        for pid, ancestors in _heap(group + [p for p in grouped if p not in members] + tail, stripes).items():
            out[pid].append(ancestors)
    return out


def plan_lanes(peers: list[PeerLink], layout: Layout) -> dict[str, list[list[str]]]:
    """``plan`` or ``plan_stripes`` in one shape: for every peer a list of lanes (one per stripe; one for an
    unstriped layout), each its ancestors nearest first."""
    if layout.kind == "stripes":
        return plan_stripes(peers, layout.fanout)
    return {pid: [ancestors] for pid, ancestors in plan(peers, layout.kind, max(1, layout.fanout)).items()}


def depth(sources: dict[str, list]) -> int:
    """Hops from the origin to the deepest peer (``plan``'s ancestors, or ``plan_lanes``' lanes of them)."""
    def hops(a: list) -> int:
        return max((len(lane) for lane in a), default=0) if a and isinstance(a[0], list) else len(a)

    return 1 + max((hops(a) for a in sources.values()), default=-1)


def levels(n: int, fanout: int) -> int:
    """Levels of a heap of ``n`` nodes with ``fanout`` children each (a chain, fanout 1, has n)."""
    if n <= 0:
        return 0
    if fanout <= 1:
        return n
    d, filled, width = 0, 0, 1
    while filled < n:
        filled, width, d = filled + width, width * fanout, d + 1
    return d


def stripes_fit(n: int, stripes: int) -> bool:
    """Whether ``stripes`` trees over ``n`` peers give every peer inner positions in one tree only (N mod s <= 1;
    see ``plan_stripes``)."""
    return n % stripes <= 1


def added_s(layout: Layout, n: int, size_bytes: float, rate_bytes_per_s: float, one_way_s: float,
            piece_bytes: int = PIECE_BYTES) -> float:
    """The pipeline's own term: seconds the last of ``n`` peers finishes after M/B, over equal links of
    ``rate_bytes_per_s`` (0: unknown, its terms left out) with one-way latency ``one_way_s``.

    Each hop below the first adds the link's latency ℓ and a wait w·f for a sender sharing its uplink among f
    streams, w = min(piece/B, FORWARD_S); a layout whose senders upload f copies (a tree) also stretches the
    transfer itself to f·M/B. chain: (N − 1)·(ℓ + w); stripes(s): (levels_s − 1)·(ℓ + s·w); tree(f):
    (f − 1)·M/B + (levels_f − 1)·(ℓ + f·w); star: (N − 1)·M/B."""
    if n <= 0:
        return 0.0
    w = min(piece_bytes / rate_bytes_per_s, FORWARD_S) if rate_bytes_per_s > 0 else FORWARD_S
    transfer_s = size_bytes / rate_bytes_per_s if rate_bytes_per_s > 0 else 0.0
    if layout.kind == "star":
        return (n - 1) * transfer_s
    f = 1 if layout.kind == "chain" else layout.fanout
    stretch = (f - 1) * transfer_s if layout.kind == "tree" else 0.0
    return stretch + (levels(n, f) - 1) * (one_way_s + f * w)


def mww_optimum_s(n: int, size_bytes: float, rate_bytes_per_s: float, chunks: int) -> float:
    """Mundinger, Weber and Weiss's optimal broadcast time for ``chunks`` equal chunks over equal links and no
    latency: (M/B)(1 + ⌊log₂N⌋/k)."""
    if n <= 0:
        return 0.0
    return size_bytes / rate_bytes_per_s * (1 + math.floor(math.log2(n)) / max(1, chunks))


def choose(n: int, one_way_s: float, rate_bytes_per_s: float, size_bytes: float,
           piece_bytes: int = PIECE_BYTES) -> Layout:
    """The layout ``auto`` runs for a round of ``n`` peers, given their one-way latency and download rate (the
    pool's medians as the learner measured them; 0 = not yet) and the bytes to send.

    The chain, unless stripes are predicted (``added_s``) to save at least STRIPES_MIN_GAIN of M/B and
    STRIPES_MIN_GAIN_S: a chain pays (N − 1) hops, stripes ~log_s N hops each s times as long in piece waits.
    Small N, or a fast LAN (latency ≪ piece/B), keep the chain; N in the tens over a WAN stripes. Candidates are
    s = 2..MAX_STRIPES with N mod s <= 1 (every peer uploads each byte once: ``plan_stripes``) and at least
    MIN_STRIPE_BYTES per stripe; among near-equal ones (STRIPES_TIE) the fewest stripes win."""
    chain = Layout("chain")
    fits = _stripe_counts(n, size_bytes, MAX_STRIPES)
    if not fits:
        return chain
    cost = {s: added_s(Layout("stripes", s), n, size_bytes, rate_bytes_per_s, one_way_s, piece_bytes) for s in fits}
    transfer_s = size_bytes / rate_bytes_per_s if rate_bytes_per_s > 0 else 0.0
    best_s = next(s for s in fits if cost[s] <= min(cost.values()) + max(STRIPES_TIE * transfer_s, 0.01))
    gain_s = added_s(chain, n, size_bytes, rate_bytes_per_s, one_way_s, piece_bytes) - cost[best_s]
    if gain_s >= max(STRIPES_MIN_GAIN * transfer_s, STRIPES_MIN_GAIN_S):
        return Layout("stripes", best_s)
    return chain


def _stripe_counts(n: int, size_bytes: float, most: int) -> list[int]:
    """Stripe counts 2..``most`` that ``n`` peers can run with each uploading each byte once (N mod s <= 1) and
    every stripe at least MIN_STRIPE_BYTES."""
    return [s for s in range(2, most + 1) if s <= n and stripes_fit(n, s) and size_bytes >= s * MIN_STRIPE_BYTES]


def layout(kind: str, fanout: int, n: int, one_way_s: float, rate_bytes_per_s: float, size_bytes: float,
           piece_bytes: int = PIECE_BYTES) -> Layout:
    """The layout a round of ``n`` peers runs under topology ``kind`` (broadcast.sender.topology): ``auto``,
    ``choose``'s pick; ``stripes``, the most stripes up to ``fanout`` that fit (N mod s <= 1, MIN_STRIPE_BYTES
    each; the chain if none does, e.g. a tiny delta); any other kind as it is."""
    if kind not in KINDS:
        raise ValueError(f"topology {kind!r}: expected one of {KINDS}")
    if kind == "auto":
        return choose(n, one_way_s, rate_bytes_per_s, size_bytes, piece_bytes)
    if kind == "stripes":
        fits = _stripe_counts(n, size_bytes, fanout)
        return Layout("stripes", max(fits)) if fits else Layout("chain")
    return Layout(kind, 1 if kind == "chain" else fanout)


def stripe_bounds(size_bytes: int, stripes: int, align_bytes: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of ``stripes`` stripes tiling a snapshot of ``size_bytes``, as equal as the alignment
    allows (the broadcaster aligns them to chunks where the snapshot has enough of them, so a chunk's digest is
    checked as soon as its one stripe has it)."""
    cuts = [0] + [min(size_bytes, round(size_bytes * j / stripes / align_bytes) * align_bytes)
                  for j in range(1, stripes)] + [size_bytes]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:])]
