"""The relay's planning (echo2/broadcast/topology.py), pure: striped layouts, the model's added time, and the
choice ``auto`` makes by N, RTT, rate and size. Tables, no sockets."""

from __future__ import annotations

import math

import pytest

from echo2 import capacity
from echo2.broadcast import framing
from echo2.broadcast import topology as topo
from echo2.broadcast.topology import Layout, PeerLink

MB = 1e6


def peers(n: int) -> list[PeerLink]:
    """n peers, w0 the fastest (rates a factor 2 apart: each its own rate class)."""
    return [PeerLink(f"w{i}", rate_bytes_per_s=2.0 ** (n - i)) for i in range(n)]


def test_the_piece_size_is_the_relays():
    assert topo.PIECE_BYTES == framing.PIECE_BYTES


@pytest.mark.parametrize("n, fanout, levels", [
    (0, 2, 0), (1, 2, 1), (2, 2, 2), (3, 2, 2), (4, 2, 3), (7, 2, 3), (8, 2, 4), (63, 2, 6), (64, 2, 7),
    (16, 4, 3), (21, 4, 3), (22, 4, 4), (64, 4, 4), (64, 3, 5), (5, 1, 5)])
def test_heap_levels(n, fanout, levels):
    assert topo.levels(n, fanout) == levels


@pytest.mark.parametrize("n, s", [(n, s) for s in (2, 3, 4) for n in (2, 3, 5, 8, 9, 13, 16, 17, 32, 33, 64) if s <= n])
def test_stripe_trees_each_peer_uploads_each_byte_about_once(n, s):
    """Every peer is in every stripe's tree once, pulls each stripe from a different parent (its downlink is split s
    ways), and where N mod s <= 1 has children in one tree only, at most s of them: it uploads s · M/s = M. The
    depth is the heap's, log_s N, not N."""
    plan = topo.plan_stripes(peers(n), s)
    assert set(plan) == {f"w{i}" for i in range(n)} and all(len(lanes) == s for lanes in plan.values())
    children: dict[str, list[int]] = {pid: [0] * s for pid in plan}  # per peer, per stripe
    for pid, lanes in plan.items():
        parents = [lane[0] if lane else "origin" for lane in lanes]
        assert len(set(parents)) == s, (pid, lanes)  # s different parents (the origin for a root's own stripe)
        for j, lane in enumerate(lanes):
            for child, parent in zip([pid] + lane, lane):  # every source list walks up stripe j's tree
                assert plan[child][j][0] == parent
            if lane:
                children[lane[0]][j] += 1
    assert topo.depth(plan) == topo.levels(n, s)
    roots = [pid for pid, lanes in plan.items() if [] in lanes]
    assert sorted(roots) == [f"w{j}" for j in range(s)]  # the s fastest: one stripe each, from the origin
    if topo.stripes_fit(n, s):
        assert all(sum(1 for c in per if c) <= 1 and sum(per) <= s for per in children.values()), children
    else:  # some peers fill an inner slot of a second tree: (1 + 1/s)·M at most
        assert all(sum(per) <= s + s - 1 for per in children.values())


def test_a_chain_and_a_tree_are_one_lane():
    ps = peers(7)
    assert topo.plan_lanes(ps, Layout("chain")) == {pid: [a] for pid, a in topo.plan(ps, "chain").items()}
    assert topo.plan_lanes(ps, Layout("tree", 2)) == {pid: [a] for pid, a in topo.plan(ps, "tree", 2).items()}
    assert topo.depth(topo.plan_lanes(ps, Layout("chain"))) == 7 == topo.depth(topo.plan(ps, "chain"))
    with pytest.raises(ValueError, match="expected chain, tree or star"):
        topo.plan(ps, "stripes")


@pytest.mark.parametrize("layout, n, expected_s", [
    # 200 MB at 1 Gbit/s (M/B 1.6 s), one-way 10 ms: w = min(piece/B, 3 ms) = 2.1 ms
    (Layout("chain"), 64, 63 * (0.010 + 0.0021)),
    (Layout("stripes", 2), 64, 6 * (0.010 + 2 * 0.0021)),
    (Layout("stripes", 4), 64, 3 * (0.010 + 4 * 0.0021)),
    (Layout("tree", 2), 64, 1.6 + 6 * (0.010 + 2 * 0.0021)),  # inner nodes upload twice
    (Layout("star"), 8, 7 * 1.6),
    (Layout("chain"), 1, 0.0),
])
def test_the_pipeline_term(layout, n, expected_s):
    assert topo.added_s(layout, n, 200 * MB, 125 * MB, 0.010) == pytest.approx(expected_s, rel=0.01)


def test_the_mww_optimum():
    """(M/B)(1 + ⌊log₂N⌋/k): 64 peers, 10 chunks: 1.6 s · (1 + 6/10)."""
    assert topo.mww_optimum_s(64, 200 * MB, 125 * MB, 10) == pytest.approx(1.6 * 1.6)
    assert topo.mww_optimum_s(1, 200 * MB, 125 * MB, 10) == pytest.approx(1.6)


# n, one-way latency s, rate MB/s (0: not measured), size MB -> the layout auto runs
CHOICES = [
    (1, 0.010, 125, 200, Layout("chain")),
    (4, 0.010, 125, 200, Layout("chain")),       # 3 hops: nothing to gain
    (8, 0.010, 125, 200, Layout("chain")),       # 7 hops of 12 ms: stripes would save < 5 % of M/B
    (16, 0.010, 125, 200, Layout("stripes", 2)),
    (64, 0.010, 125, 200, Layout("stripes", 2)),  # 6 hops, not 63
    (8, 0.040, 125, 200, Layout("stripes", 4)),  # 80 ms RTT: a chain's 7 hops are 0.3 s
    (64, 0.040, 125, 200, Layout("stripes", 4)),
    (32, 0.040, 125, 200, Layout("stripes", 4)),  # 32 mod 4 = 0: fits
    (31, 0.040, 125, 200, Layout("stripes", 3)),  # 31 mod 4 = 3, 31 mod 3 = 1
    (32, 0.001, 125, 200, Layout("chain")),      # a LAN: 31 hops of 3 ms are < 6 % of M/B; stripes save < 5 %
    (64, 0.0001, 125, 200, Layout("stripes", 2)),  # ... but 63 hops of 2 ms are 9 %
    (64, 0.010, 0, 200, Layout("stripes", 4)),   # rate not measured yet: latency alone decides
    (8, 0.010, 0, 200, Layout("chain")),
    (64, 0.010, 125, 0.1, Layout("chain")),      # a tiny delta: a stripe of it would be a few packets
]


@pytest.mark.parametrize("n, one_way_s, rate_mb, size_mb, expected", CHOICES)
def test_auto_picks_the_chain_where_it_is_best_and_stripes_where_n_and_rtt_grow(n, one_way_s, rate_mb, size_mb,
                                                                                expected):
    assert topo.choose(n, one_way_s, rate_mb * MB, size_mb * MB) == expected


@pytest.mark.parametrize("n", [8, 16, 32, 64])
@pytest.mark.parametrize("one_way_s", [0.010, 0.040])
def test_auto_depends_on_m_over_b_not_on_the_rate(n, one_way_s):
    """200 MB at 1 Gbit/s, 20 MB at 100 Mbit/s, 2 MB at 10 Mbit/s: the same M/B, the same choice (what lets the
    bench scale both where the box cannot carry 64 links at 1 Gbit/s)."""
    picks = {topo.choose(n, one_way_s, rate_mb * MB, 1.6 * rate_mb * MB) for rate_mb in (125, 12.5, 1.25)}
    assert len(picks) == 1, picks


def test_the_chosen_layout_is_the_fastest_the_model_knows_within_its_margins():
    for n in range(1, 130):
        for one_way_s in (0.0005, 0.005, 0.010, 0.040, 0.100):
            got = topo.choose(n, one_way_s, 125 * MB, 200 * MB)
            chain_s = topo.added_s(Layout("chain"), n, 200 * MB, 125 * MB, one_way_s)
            got_s = topo.added_s(got, n, 200 * MB, 125 * MB, one_way_s)
            assert got_s <= chain_s
            if got.kind == "stripes":
                assert topo.stripes_fit(n, got.fanout) and chain_s - got_s >= 0.05 * 1.6
            best_s = min([chain_s] + [topo.added_s(Layout("stripes", s), n, 200 * MB, 125 * MB, one_way_s)
                                      for s in range(2, topo.MAX_STRIPES + 1) if s <= n and topo.stripes_fit(n, s)])
            assert got_s <= best_s + 0.05 * 1.6 + 0.02 * 1.6 + 1e-9


@pytest.mark.parametrize("kind, fanout, n, size_mb, expected", [
    ("chain", 2, 16, 200, Layout("chain")),
    ("tree", 3, 16, 200, Layout("tree", 3)),
    ("star", 2, 16, 200, Layout("star", 2)),
    ("stripes", 4, 16, 200, Layout("stripes", 4)),
    ("stripes", 4, 13, 200, Layout("stripes", 4)),  # 13 mod 4 = 1
    ("stripes", 4, 14, 200, Layout("stripes", 2)),  # 14 mod 4 = 2, 14 mod 3 = 2: two stripes (always fit)
    ("stripes", 4, 3, 200, Layout("stripes", 3)),
    ("stripes", 4, 1, 200, Layout("chain")),         # one peer: nothing to stripe
    ("stripes", 2, 16, 0.1, Layout("chain")),        # a tiny delta
    ("auto", 2, 64, 200, Layout("stripes", 2)),
])
def test_the_layout_a_topology_names(kind, fanout, n, size_mb, expected):
    assert topo.layout(kind, fanout, n, 0.010, 125 * MB, size_mb * MB) == expected
    with pytest.raises(ValueError, match="expected one of"):
        topo.layout("ring", 2, n, 0.010, 125 * MB, size_mb * MB)


@pytest.mark.parametrize("size, s, align", [(10, 3, 1), (200_000_000, 4, 4 << 20), (2_000_000, 2, 4096),
                                            (5, 4, 1), (0, 2, 1)])
def test_stripe_bounds_tile_the_snapshot(size, s, align):
    bounds = topo.stripe_bounds(size, s, align)
    assert len(bounds) == s and bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(lo <= hi for lo, hi in bounds)
    assert all(lo % align == 0 for lo, _ in bounds)
    if size >= 2 * s * align:
        assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= align


def test_the_capacity_model_knows_auto_and_stripes():
    """broadcast=pipelined runs auto now: the capacity model's pipelined is the least of chain and stripes, flat
    in N where the chain grows by a latency per worker, and monotone in N (what exact activation relies on)."""
    args = dict(snapshot_bytes=200 * MB, learner_uplink_mbit=1000, down_mbit=1000, up_mbit=1000, rtt_ms=20)
    t = {m: [capacity.bcast_time_s(m, workers=n, **args) for n in range(1, 130)] for m in ("chain", "auto")}
    assert t["auto"] == [capacity.bcast_time_s("pipelined", workers=n, **args) for n in range(1, 130)]
    assert all(a <= c for a, c in zip(t["auto"], t["chain"]))
    assert all(a <= b for a, b in zip(t["auto"], t["auto"][1:]))
    transfer_s = 200 * MB / (1000e6 / 8 * capacity.GOODPUT)
    assert t["chain"][63] - transfer_s > 0.6  # 64 hops of 10 ms and more
    assert t["auto"][63] - transfer_s < 0.15 and math.isfinite(t["auto"][-1])
    assert capacity.bcast_time_s("stripes", workers=64, fanout=4, **args) < capacity.bcast_time_s(
        "tree", workers=64, fanout=4, **args)  # same depth, but a tree's inner nodes upload 4 copies


@pytest.mark.parametrize("n, unknown, s", [(4, 1, 2), (8, 2, 2), (9, 3, 3), (17, 4, 4), (64, 5, 4)])
def test_no_unmeasured_peer_is_an_ancestor_of_a_measured_one_in_any_stripe(n, unknown, s):
    """A peer without a measured rate (new, or planned last because a successor said its relay failed) closes
    every stripe's tree: a measured peer never pulls a stripe from it (N mod s == 0 had put the last-ranked peer
    in an inner position of its group's tree)."""
    links = [PeerLink(f"w{i}", 0.0 if i < unknown else 1e6 * (1 + i % 3), 0.01) for i in range(n)]
    plan = topo.plan_stripes(links, s)
    unmeasured = {f"w{i}" for i in range(unknown)}
    for pid, lanes in plan.items():
        if pid not in unmeasured:
            assert not unmeasured & {a for lane in lanes for a in lane}, (pid, lanes)
    assert all(len(lanes) == s for lanes in plan.values())


def test_stripes_over_peers_none_of_them_measured_yet_are_laid_out_as_if_all_were_equal():
    """The first round (no rate measured): all peers make the groups, as peers of one measured rate would."""
    assert (topo.plan_stripes([PeerLink(f"w{i}") for i in range(9)], 2)
            == topo.plan_stripes([PeerLink(f"w{i}", 1e6) for i in range(9)], 2))
