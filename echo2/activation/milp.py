"""Activation past the exact DP's size: a best-first search over boxes of sets, with a proven optimality gap.

The exact DP (solve.py) costs O(link structures × N² × total cents) and refuses pools of a few hundred priced
workers; a real pool can hold thousands. This solver answers any pool within a time limit and proves how far
its answer can be from the optimum. Pure: numbers in, a plan out (scipy's HiGHS is a library, not a service).

The objective is not linear: cost per step = (learner $/h + Σ_A c_i)/3600 × T_step(μ_A, T_bcast(A)) is a
price times a step time that falls with the set's throughput μ_A and rises with its size and its worst link.
So the sets of two or more workers are split into *boxes*: a link band (where the set's slowest effective rate
and longest RTT lie, below), a range of sizes [a, b] and a range of throughput [m_lo, m_hi]. Every set in a
box costs at least

    LB = (learner $/h + P)/3600 × T_step(m_hi, T_bcast(a, the best links a set in the band can have))

where P bounds from below the price of at most b of the band's allowed workers with μ ≥ m_lo: the Lagrangian
dual of its LP relaxation (a fractional knapsack on (c_i + λ)/μ_i for each multiplier λ of the size limit;
every λ gives a valid bound), raised to HiGHS's dual bound once the box's MILP ran. Sets of one worker are all
priced exactly instead (a single worker's uplink does not count, so no band bounds them).

Search, always from the lowest bound: a box that could still gain (its bound would rise if its μ, its size or
its link band were known more precisely: ``mu_slack``, ``n_slack``, ``link_slack``) is split along the
dimension that gains most, and boxes of large sets (``LP_TIGHT_SIZE`` workers or more, where the LP is nearly
the integer problem) are split ``BULK`` at a time, their bounds computed in one vectorised call. A narrow box
is searched: large sets by Lagrangian rounding (whole workers in (c_i + λ)/μ_i order until μ ≥ m_lo), then,
if it stays lowest, by a MILP; small sets by a MILP at once (min Σ c_i x_i s.t. Σ μ_i x_i ≥ m_lo,
a ≤ Σ x_i ≤ b; scipy.optimize.milp, a share of the time left). Every set found is priced exactly
(solve.evaluate) as a candidate. It stops when the best candidate is within ``rel_gap`` of the lowest bound,
when the lowest box cannot be split any more, or at ``time_limit_s`` (checked between steps; a step is at most
a few tenths of a second). The plan's ``gap`` is best / lowest bound − 1: a proof, up to T_step being
non-increasing in μ (true of the closed form; the round map's ~0.05 % averaging noise is the caveat, as for
the DP). The caller's current set (offered first, so that ties keep it), greedy, all-on and the best single
worker seed the candidates: the answer is never worse than any of them.

Workers with the same price, throughput and links are one class with a count (a replicated market becomes a
small integer program). A link structure is two-dimensional: for a set of two or more, the relay's
dissemination time depends on a worker's links only through one effective rate (chain: min(down, up); tree:
min(down, up / fanout); star: down; capacity.bcast_time_s) and its RTT. Measured links are all distinct, so the
first bands are cut at ``MAX_RATE_LEVELS`` × ``MAX_RTT_LEVELS`` of the distinct values, and a band is split at
its median value where it holds the bound (``link_slack``): quantizing loosens the bound until then, never the
proof.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp  # imported with the module: not inside the time limit

from echo2 import capacity
from echo2.activation import solve as base

MAX_RATE_LEVELS = 16  # effective link rates kept as thresholds (measured links: every worker distinct)
MAX_RTT_LEVELS = 8  # RTT thresholds: at most 128 link structures
RHO_START = 2.0  # the first boxes span a factor 2 in μ and in set size; splitting refines where it pays
MILP_SHARE = 0.25  # one box's MILP may take this share of the time left (its dual bound counts even if cut short)
LP_TIGHT_SIZE = 16  # sets at least this large: one fractional worker is a small share of the price (LP ≈ MILP)
BULK = 256  # boxes split per round at most (the lowest bounds): best first, in vectorised batches
MAX_BOXES = 400_000  # open boxes kept at most (memory); past it, the lowest box is searched or split alone
LAMBDAS = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)  # size multipliers, × the median worker price


@dataclass
class _Cell:
    """One link structure: sets whose slowest effective rate lies in [rate_lo, rate_hi) and whose longest RTT
    lies in (rtt_lo, rtt_hi]; any worker at least that good may join them."""

    rate_lo: float
    rate_hi: float
    rtt_lo: float
    rtt_hi: float
    allowed: np.ndarray  # class indices: rate ≥ rate_lo and RTT ≤ rtt_hi
    best: tuple[float, float, float]  # bcast_time_s's (down, up, rtt) for the best such a set (of 2+) can have
    worst: tuple[float, float, float]  # the same for the worst: the band's loosest links
    divisible: tuple[bool, bool] = (False, False)  # whether its rate band, its RTT band hold 2+ distinct values
    splits: dict = field(default_factory=dict)  # "rate" / "rtt": the two cells this one splits into (memo)
    lam_cum: list = field(default_factory=list)  # per multiplier: cumulative μ and price + λ by ratio, the order
    mu_desc_cum: np.ndarray | None = None  # cumulative μ of the fastest workers first: the most μ k workers give


@dataclass
class _Box:
    """Sets of a..b workers from one link band with throughput in [m_lo, m_hi]; ``lb`` bounds their cost per step."""

    cell: int
    a: int
    b: int
    m_lo: float
    m_hi: float
    price_lb: float = 0.0  # HiGHS's dual bound on the price, once its MILP ran (inherited by its halves)
    lb: float = math.inf
    searched: bool = False
    rounded: bool = False  # Lagrangian rounding done (sets of LP_TIGHT_SIZE or more)
    bounded_meeting: bool = False  # bounded when the best plan met the utilization floor
    mu_slack: float = math.inf  # how far knowing μ more precisely could raise the bound (a fraction of it)
    n_slack: float = math.inf  # the same for the size
    link_slack: float = 0.0  # the same for the link band


def solve_large(system: base.System, workers: list[base.Worker], time_limit_s: float = 2.0, rel_gap: float = 1e-3,
                incumbent: list[base.Worker] | None = None) -> base.Plan:
    """The best plan found within ``time_limit_s``, with ``gap`` and ``lower_bound_usd_per_step`` set."""
    t0 = time.perf_counter()
    workers = [w for w in workers if w.rollouts_per_s > 0]  # a worker that generates nothing only adds cost
    if not workers:
        return base.evaluate(system, [], "milp")
    search = _Search(system, workers, t0 + max(time_limit_s, 0.0), rel_gap)
    if incumbent:  # first: a candidate only replaces it if strictly better, so ties keep the set now active
        alive = {w.id for w in workers}
        search.offer(base.evaluate(system, [w for w in incumbent if w.id in alive]))
    for seed in (base.greedy(system, workers), base.all_on(system, workers), _best_single(system, workers)):
        search.offer(seed)
    lb = search.run()
    best = search.best
    gap = 0.0 if best.usd_per_step <= lb else (best.usd_per_step / lb - 1 if lb > 0 else math.inf)
    note = (f"milp: {len(workers)} workers in {len(search.classes)} classes, {search.cells_used} link structures, "
            f"{search.searched} boxes searched in {time.perf_counter() - t0:.2f} s; gap {gap:.2%}")
    return replace(best, solver="milp", gap=gap, lower_bound_usd_per_step=lb, notes=best.notes + (note,))


class _Search:
    def __init__(self, system: base.System, workers: list[base.Worker], deadline: float, rel_gap: float):
        self.system, self.deadline, self.rel_gap = system, deadline, rel_gap
        self.classes, self.members = _classes(workers)
        c = self.classes
        self.price = np.array([k[0] for k in c])
        self.mu = np.array([k[1] for k in c])
        self.count = np.array([len(m) for m in self.members], dtype=float)
        down = np.array([k[2] for k in c])
        self.fan = system.fanout if capacity.topology_of(system.broadcast) == "tree" else 1
        self.rate = down if capacity.topology_of(system.broadcast) == "star" else np.minimum(
            down, np.array([k[3] for k in c]) / self.fan)
        self.rtt = np.array([k[4] for k in c])
        self.cells = self._cells()
        self.best: base.Plan | None = None
        self.searched = 0
        self.lambdas = [lam * (float(np.median(self.price)) if np.any(self.price > 0) else 1.0) for lam in LAMBDAS]
        for cell in self.cells:
            self._prepare(cell)

    # ---------------------------------------------------------------- bounds

    @property
    def cells_used(self) -> int:
        return len(self.cells)

    def _prepare(self, cell: _Cell) -> None:
        idx = cell.allowed
        mu, price, count = self.mu[idx], self.price[idx], self.count[idx]
        for lam in self.lambdas:
            order = np.argsort((price + lam) / mu, kind="stable")
            cum_mu = np.concatenate(([0.0], np.cumsum(mu[order] * count[order])))
            cum_cost = np.concatenate(([0.0], np.cumsum((price[order] + lam) * count[order])))
            cell.lam_cum.append((lam, cum_mu, cum_cost, order))
        fastest = np.argsort(-mu, kind="stable")
        per_worker = np.repeat(mu[fastest], count[fastest].astype(int))
        cell.mu_desc_cum = np.concatenate(([0.0], np.cumsum(per_worker)))

    def price_lb(self, cell: _Cell, m, b: int) -> np.ndarray:
        """A lower bound on the price ($/h) of at most b of the cell's workers with μ ≥ m (inf: none reach m)."""
        m = np.atleast_1d(np.asarray(m, dtype=float))
        out = np.zeros_like(m)
        for lam, cum_mu, cum_cost, _ in cell.lam_cum:
            out = np.maximum(out, np.interp(m, cum_mu, cum_cost) - lam * b)
        top = cell.mu_desc_cum[min(b, len(cell.mu_desc_cum) - 1)]
        return np.where(m > top * (1 + 1e-12), np.inf, out)

    def bcast(self, links: tuple[float, float, float], n: int) -> float:
        s = self.system
        return capacity.bcast_time_s(s.broadcast, s.snapshot_bytes, s.learner_uplink_mbit, n, *links, s.fanout)

    def closed_step(self, bcast_s, mu) -> np.ndarray:
        """capacity's closed form for T_step: a lower bound on the round map's, at a fraction of its cost."""
        s = self.system
        return np.asarray(capacity.step_time_s(s.rollouts_per_step, s.train_step_s, s.staleness - s.interval + 1,
                                               bcast_s + s.load_s + s.batch_s, mu, s.interval), dtype=float)

    def step(self, bcast_s, mu) -> np.ndarray:
        s = self.system
        return capacity.mean_step_s(s.rollouts_per_step, s.train_step_s, s.staleness, s.interval, bcast_s,
                                    s.load_s + s.batch_s, mu)

    def bound(self, boxes: list[_Box]) -> None:
        """Each box's lower bound, and how much splitting it could raise it (``mu_slack``, ``n_slack``,
        ``link_slack``: knowing its μ, its size, its links better). Vectorised: one round-map call prices all boxes;
        the slacks are a heuristic, from the closed form, or the round map where the closed form calls a box narrow."""
        if not boxes:
            return
        s, k = self.system, len(boxes)
        bc_a = np.array([self.bcast(self.cells[x.cell].best, x.a) for x in boxes])
        bc_b = np.array([self.bcast(self.cells[x.cell].best, x.b) for x in boxes])
        m_lo, m_hi = np.array([x.m_lo for x in boxes]), np.array([x.m_hi for x in boxes])
        step_lb = self.step(bc_a, m_hi)
        # How much splitting could help is only a heuristic: the closed form (cheap, no round map) will do.
        bc_w = np.array([self.bcast(self.cells[x.cell].worst, x.a) for x in boxes])
        closed = self.closed_step(np.concatenate([bc_a, bc_b, bc_a, bc_w]), np.concatenate([m_hi, m_hi, m_lo, m_hi]))
        c_lb, c_b, c_lo, c_w = closed[:k], closed[k:2 * k], closed[2 * k:3 * k], closed[3 * k:]
        p_lo, p_hi = np.array([x.price_lb for x in boxes]), np.zeros(k)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, x in enumerate(boxes):
            groups.setdefault((x.cell, x.b), []).append(i)
        for (cell, b), rows in groups.items():
            p_lo[rows] = np.maximum(p_lo[rows], self.price_lb(self.cells[cell], m_lo[rows], b))
            p_hi[rows] = self.price_lb(self.cells[cell], m_hi[rows], b)
        usd = s.learner_usd_per_hour
        lb = (usd + p_lo) / 3600 * step_lb
        mu_slack, n_slack, link_slack = _slacks(usd, p_lo, p_hi, c_lb, c_lo, c_b, c_w)
        # The closed form cannot see queued dissemination: where it calls a box narrow, ask the round map.
        near = np.flatnonzero(np.maximum(np.maximum(mu_slack, n_slack), link_slack) <= self.rel_gap / 4)
        if near.size:
            m = self.step(np.concatenate([bc_b[near], bc_a[near], bc_w[near]]),
                          np.concatenate([m_hi[near], m_lo[near], m_hi[near]]))
            j = near.size
            mu_slack[near], n_slack[near], link_slack[near] = _slacks(usd, p_lo[near], p_hi[near], step_lb[near],
                                                                     m[j:2 * j], m[:j], m[2 * j:])
        can_meet = s.train_step_s / step_lb >= s.min_utilization - 1e-9
        meets = self._best_meets()
        for x, low, ok, ms, ns, ls in zip(boxes, lb.tolist(), can_meet.tolist(), mu_slack.tolist(), n_slack.tolist(),
                                          link_slack.tolist()):
            # A box none of whose sets can meet the utilization floor cannot beat a plan that meets it.
            x.lb = low if ok or not meets else math.inf
            x.mu_slack, x.n_slack, x.link_slack, x.bounded_meeting = ms, ns, ls, meets

    def _best_meets(self) -> bool:
        return self.best is not None and self.best.meets_min_utilization

    # ---------------------------------------------------------------- the search

    def offer(self, plan: base.Plan) -> None:
        if plan.active and base._better(plan, self.best):
            self.best = plan

    def initial_boxes(self) -> list[_Box]:
        boxes = []
        for ci, cell in enumerate(self.cells):
            n_max = len(cell.mu_desc_cum) - 1
            lo_mu = float(self.mu[cell.allowed].min())
            for a, b in _spans(2, n_max):  # sets of one: enumerated exactly (_best_single)
                top = float(cell.mu_desc_cum[b])
                for m_lo, m_hi in _geometric(lo_mu, top):
                    boxes.append(self._box(ci, a, b, m_lo, m_hi))
        self.bound(boxes)
        return boxes

    def _box(self, cell: int, a: int, b: int, m_lo: float, m_hi: float, price_lb: float = 0.0) -> _Box:
        return _Box(cell, a, b, m_lo, m_hi, price_lb)

    def run(self) -> float:
        """Search until the gap closes, nothing can be tightened, or time is up; the lowest bound left.

        Always the lowest bound first. While it is a wide box of sets of at least LP_TIGHT_SIZE workers (whose
        Lagrangian bound is nearly the integer one), it and the next lowest such boxes are split in one batch
        (cheap: one vectorised call bounds all children). Otherwise the box is searched (Lagrangian rounding for
        large sets, a MILP for small ones, where the LP is loose and one MILP raises the bound most), then split."""
        boxes = [x for x in self.initial_boxes() if math.isfinite(x.lb)]
        while time.perf_counter() < self.deadline:
            cutoff = self._cutoff()
            boxes = [x for x in boxes if x.lb < cutoff]
            blocking = [x for x in boxes if x.lb * (1 + self.rel_gap) < cutoff]
            if not blocking:
                break
            if self._best_meets():  # a floor-meeting plan turned up since these were bounded: re-bound them
                stale = [x for x in blocking if not x.bounded_meeting]
                if stale:
                    self.bound(stale)
                    continue
            box = min(blocking, key=lambda x: x.lb)
            # Sets of many workers: the LP bound is nearly the integer one, so split these without a MILP, the
            # lowest BULK of them at once (best first, in one vectorised batch).
            if box.a >= LP_TIGHT_SIZE and not self._narrow(box) and len(boxes) + BULK <= MAX_BOXES:
                bulk = sorted((x for x in blocking if x.a >= LP_TIGHT_SIZE and not self._narrow(x)),
                              key=lambda x: x.lb)[:BULK]
                kept = {id(x) for x in bulk}
                boxes = [x for x in boxes if id(x) not in kept] + self._split_all(bulk)
                continue
            if not box.searched:
                self.search_box(box)
                continue
            children = self.split(box)
            if children is None:  # atomic: its bound is what its MILP proved, and stands
                break
            boxes.remove(box)
            boxes += children
        lows = [x.lb for x in boxes]
        return min([self._cutoff()] + lows)

    def _narrow(self, box: _Box) -> bool:
        """Worth a MILP: splitting it (μ, size or link band) could raise its bound by under a quarter of the gap."""
        return max(self._slacks(box).values()) <= self.rel_gap / 4

    def _slacks(self, box: _Box) -> dict[str, float]:
        cell = self.cells[box.cell]
        return {"mu": box.mu_slack if box.m_hi > box.m_lo * (1 + 1e-9) else 0.0,
                "n": box.n_slack if box.b > box.a else 0.0,
                "link": box.link_slack if self._splittable(cell, "rate") or self._splittable(cell, "rtt") else 0.0}

    def _halves(self, box: _Box, how: str) -> list[_Box]:
        """The two boxes ``box`` splits into along ``how`` (mu, n or link), unbounded."""
        kw = dict(price_lb=box.price_lb)
        if how == "mu":
            mid = math.sqrt(box.m_lo * box.m_hi) if box.m_lo > 0 else box.m_hi / 2
            return [self._box(box.cell, box.a, box.b, box.m_lo, mid, **kw),
                    self._box(box.cell, box.a, box.b, mid, box.m_hi, **kw)]
        if how == "n":
            mid_n = (box.a + box.b) // 2
            return [self._box(box.cell, box.a, mid_n, box.m_lo, box.m_hi, **kw),
                    self._box(box.cell, mid_n + 1, box.b, box.m_lo, box.m_hi, **kw)]
        cell = self.cells[box.cell]
        dim = "rate" if self._splittable(cell, "rate") else "rtt"
        # The parent's MILP dual bound holds in both halves: each half allows the same workers or fewer.
        return [self._box(c, box.a, box.b, box.m_lo, box.m_hi, **kw) for c in self._split_cell(box.cell, dim)]

    def _split_all(self, wide: list[_Box]) -> list[_Box]:
        """Each wide box in two, along what could raise its bound most (μ, size or link band); bounded at once."""
        children = []
        for box in wide:
            slack = self._slacks(box)
            children += self._halves(box, max(slack, key=slack.get))
        self.bound(children)
        return [x for x in children if math.isfinite(x.lb)]

    # ---------------------------------------------------------------- link bands

    def _cells(self) -> list[_Cell]:
        """The first link structures: at most MAX_RATE_LEVELS × MAX_RTT_LEVELS bands cut at distinct values."""
        e_lv, r_lv = _levels(self.rate, MAX_RATE_LEVELS), _levels(self.rtt, MAX_RTT_LEVELS, reverse=True)
        cells = []
        for ei, e in enumerate(e_lv):
            for ri, r in enumerate(r_lv):
                cell = self._cell(e, e_lv[ei + 1] if ei + 1 < len(e_lv) else math.inf, r_lv[ri + 1] if ri + 1 <
                                  len(r_lv) else -math.inf, r)
                if cell is not None:
                    cells.append(cell)
        return cells

    def _cell(self, rate_lo: float, rate_hi: float, rtt_lo: float, rtt_hi: float) -> _Cell | None:
        allowed = np.flatnonzero((self.rate >= rate_lo) & (self.rtt <= rtt_hi))
        in_rate = self.rate[(self.rate >= rate_lo) & (self.rate < rate_hi)]
        in_rtt = self.rtt[(self.rtt <= rtt_hi) & (self.rtt > rtt_lo)]
        if not (allowed.size and in_rate.size and in_rtt.size):
            return None  # no set's slowest rate or longest RTT falls in this band
        e_best, r_best = float(in_rate.max()), float(in_rtt.min())
        # bcast_time_s takes (down, up): these give the band's best (worst) effective rate for sets of 2 or more.
        divisible = (bool(in_rate.min() < in_rate.max()), bool(in_rtt.min() < in_rtt.max()))
        return _Cell(rate_lo, rate_hi, rtt_lo, rtt_hi, allowed, (e_best, e_best * self.fan, r_best),
                     (rate_lo, rate_lo * self.fan, rtt_hi), divisible)

    @staticmethod
    def _splittable(cell: _Cell, dim: str) -> bool:
        return cell.divisible[0] if dim == "rate" else cell.divisible[1]

    def _split_cell(self, ci: int, dim: str) -> list[int]:
        """The cell's band in two at its median distinct value (memoised: every box of the cell shares them)."""
        cell = self.cells[ci]
        if dim not in cell.splits:
            if dim == "rate":
                vals = np.unique(self.rate[(self.rate >= cell.rate_lo) & (self.rate < cell.rate_hi)])
                mid = float(vals[len(vals) // 2])
                halves = [(cell.rate_lo, mid, cell.rtt_lo, cell.rtt_hi), (mid, cell.rate_hi, cell.rtt_lo, cell.rtt_hi)]
            else:
                vals = np.unique(self.rtt[(self.rtt <= cell.rtt_hi) & (self.rtt > cell.rtt_lo)])
                mid = float(vals[(len(vals) - 1) // 2])
                halves = [(cell.rate_lo, cell.rate_hi, mid, cell.rtt_hi),
                          (cell.rate_lo, cell.rate_hi, cell.rtt_lo, mid)]
            ids = []
            for band in halves:
                child = self._cell(*band)
                if child is not None:
                    self._prepare(child)
                    self.cells.append(child)
                    ids.append(len(self.cells) - 1)
            cell.splits[dim] = ids
        return cell.splits[dim]

    def _cutoff(self) -> float:
        return self.best.usd_per_step if self.best is not None else math.inf

    def search_box(self, box: _Box) -> None:
        """Candidates for the box, priced exactly, and its bound raised. Sets of LP_TIGHT_SIZE or more: Lagrangian
        rounding (whole workers in (price + λ)/μ order until μ ≥ m_lo, for each multiplier; the LP bound is
        already nearly the integer one). Smaller sets: HiGHS, the cheapest a..b workers of the box's cell with
        μ ≥ m_lo, whose dual bound raises the box's."""
        cell = self.cells[box.cell]
        if box.a >= LP_TIGHT_SIZE and not box.rounded:
            box.rounded = True
            box.searched = not self._narrow(box)  # narrow: a MILP next if it stays lowest (the integrality gap)
            for *_, order in cell.lam_cum:
                self.offer(base.evaluate(self.system, self._rounded(cell.allowed[order], box.m_lo), "milp"))
            return
        self.searched += 1
        box.searched = True
        idx = cell.allowed
        left = self.deadline - time.perf_counter()
        A = np.vstack([self.mu[idx], np.ones(idx.size)])
        res = milp(self.price[idx], integrality=np.ones(idx.size),
                   bounds=Bounds(np.zeros(idx.size), self.count[idx]),
                   constraints=LinearConstraint(A, [box.m_lo, box.a], [np.inf, box.b]),
                   options={"time_limit": max(min(left, MILP_SHARE * left + 0.05), 0.01),
                            "mip_rel_gap": self.rel_gap / 10, "disp": False})
        if res.status == 2:  # infeasible: no set in this box
            box.lb = math.inf
            return
        dual = getattr(res, "mip_dual_bound", None)
        if dual is not None and math.isfinite(dual):
            box.price_lb = max(box.price_lb, float(dual))
        if res.x is not None:
            chosen = []
            for k, n in zip(idx, np.round(res.x).astype(int)):
                chosen.extend(self.members[k][:n])
            self.offer(base.evaluate(self.system, sorted(chosen, key=lambda w: w.id), "milp"))
        self.bound([box])

    def _rounded(self, classes: np.ndarray, mu_needed: float) -> list[base.Worker]:
        """Whole workers of ``classes`` in that order until their throughput reaches ``mu_needed``."""
        chosen, mu = [], 0.0
        for k in classes:
            take = min(len(self.members[k]), max(0, math.ceil((mu_needed - mu) / self.mu[k] - 1e-9)))
            chosen.extend(self.members[k][:take])
            mu += take * self.mu[k]
            if mu >= mu_needed:
                break
        return sorted(chosen, key=lambda w: w.id)

    def split(self, box: _Box) -> list[_Box] | None:
        """Split along whichever of μ, size and link band raises its children's bounds most (the lower child first);
        None when it is a single size, a single throughput and a single link value: its bound is what its MILP
        proved."""
        slack = self._slacks(box)
        options = [self._halves(box, how) for how in ("mu", "n", "link")
                   if (how == "mu" and box.m_hi > box.m_lo * (1 + 1e-6)) or (how == "n" and box.b > box.a)
                   or (how == "link" and slack["link"] > 0)]
        options = [kids for kids in options if kids]
        if not options:
            return None
        for children in options:
            self.bound(children)
        return max(options, key=lambda kids: sorted(k.lb for k in kids))


def _slacks(usd_h, p_lo, p_hi, step, step_lo, step_b, step_worst):
    """How far a box's bound could rise if its μ (price at m_hi, step at m_lo), its size (step at b) or its link
    band (step with the band's worst links) were known exactly, as fractions of the bound."""
    with np.errstate(invalid="ignore", divide="ignore"):
        lb = (usd_h + p_lo) * step
        mu = np.nan_to_num(np.minimum((usd_h + p_hi) * step, (usd_h + p_lo) * step_lo) / lb - 1, nan=0.0)
        return mu, np.nan_to_num(step_b / step - 1, nan=0.0), np.nan_to_num(step_worst / step - 1, nan=0.0)


def _classes(workers: list[base.Worker]):
    """Identical workers (price, throughput, links) as one class: keys, and each class's workers by id."""
    groups: dict[tuple, list[base.Worker]] = {}
    for w in sorted(workers, key=lambda w: w.id):
        groups.setdefault((w.usd_per_hour, w.rollouts_per_s, w.down_mbit, w.up_mbit, w.rtt_ms), []).append(w)
    keys = list(groups)
    return keys, [groups[k] for k in keys]


def _levels(values: np.ndarray, most: int, reverse: bool = False) -> list[float]:
    """At most ``most`` thresholds from the distinct values, the worst always included (every worker may join the
    loosest structure)."""
    distinct = sorted(set(values.tolist()), reverse=reverse)
    if len(distinct) <= most:
        return distinct
    picks = np.linspace(0, len(distinct) - 1, most).round().astype(int)
    return [distinct[i] for i in sorted(set(picks))]


def _best_single(system: base.System, workers: list[base.Worker]) -> base.Plan:
    """Every set of one worker priced at once (its uplink does not count, so the boxes, which bound sets of two
    or more by an effective rate, leave these out): the best by ``_better``'s order."""
    bc = np.array([capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit, 1,
                                         w.down_mbit, w.up_mbit, w.rtt_ms, system.fanout) for w in workers])
    mu = np.array([w.rollouts_per_s for w in workers])
    step = capacity.mean_step_s(system.rollouts_per_step, system.train_step_s, system.staleness, system.interval, bc,
                                system.load_s + system.batch_s, mu)
    usd = (system.learner_usd_per_hour + np.array([w.usd_per_hour for w in workers])) / 3600 * step
    misses = system.train_step_s / step < system.min_utilization - 1e-9
    return base.evaluate(system, [workers[int(np.lexsort((usd, misses))[0])]])


def _spans(lo: int, hi: int) -> list[tuple[int, int]]:
    """Set sizes lo..hi in spans that double: [2, 3], [4, 7], [8, 15], ..."""
    out, a = [], lo
    while a <= hi:
        b = min(hi, max(a, int(a * RHO_START) - 1))
        out.append((a, b))
        a = b + 1
    return out


def _geometric(lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi] in spans of a factor RHO_START (the last ends at hi)."""
    if hi <= lo:
        return [(lo, max(lo, hi))]
    edges = [lo]
    while edges[-1] * RHO_START < hi:
        edges.append(edges[-1] * RHO_START)
    edges.append(hi)
    return list(zip(edges[:-1], edges[1:]))
