"""The overlap-based capacity model for echo2 as built: how much rollout throughput keeps the learner busy.

Pure: numbers in, numbers out (no sockets, threads or torch). Used by activation (echo2/activation/), the plan
CLI (``python -m echo2.plan``) and the simulator (``python -m echo2.sim``).

Symbols (units in names in the code): R rollouts per learner step; T_train seconds of learner compute per step;
κ publish period (steps); S staleness bound; M snapshot bytes; T_bcast seconds until the last active worker
holds a snapshot (``bcast_time_s``); T_load seconds to apply it in the engine; T_batch seconds of one worker
batch (a batch runs on one version, so a new snapshot waits for the batch in progress); μ_i rollouts/s of
worker i; μ = Σ_{i∈A} μ_i.

Derivation. Let the learner's steps last T_step = T_train + I (I: time it waits for rollouts). Version v is
published when step v−1's compute ends and is usable by every worker L = T_bcast + T_load + T_batch later.
Step t may consume rollouts from versions x ≥ t − S (docs/design.md §1). Only every κ-th version is published,
so in the worst phase the oldest usable published version is p = t − S + κ − 1, usable from p·T_step + L; step
t's R rollouts must be ready when its compute starts, at t·T_step + I. Its generation window is therefore

    W = (S − κ + 1)·T_step + I − L

and the R rollouts fit if R/μ ≤ W. Consecutive windows overlap once W ≥ T_step, and then only the rate
matters: μ·T_step ≥ R. The worst phase recurs once per κ steps (the first step served by a newly published
version, a "block start"); a wait there also lengthens the windows of the block starts between p and t, of
which there are w = ⌊(S − κ + 1)/κ⌋ + 1 counting t. So each κ-step cycle waits once, for

    I = max(0, (R/μ + L − (S − κ + 1)·T_train) / w),   mean T_step = max(T_train + I/κ, R/μ)

(κ = 1: I = max(0, (R/μ + L − S·T_train)/(S + 1)) every step), so utilization U = T_train / T_step, and the
learner never waits (U = 1) iff

    μ ≥ μ_req = R / min(T_train, (S − κ + 1)·T_train − L),   feasible only if (S − κ + 1)·T_train > L.

T_batch is the wait for the batch in progress when a snapshot lands: a worker applies between batches, so on
average half a batch; aggregated over workers (each holds a batch of b rollouts), N·b / (2μ).

Checks: S = 0, κ = 1 gives T_step = T_train + L + R/μ (synchronous: train, disseminate, generate, in turn).
Large S gives μ_req → R/T_train (rate matching). A larger L (slow WAN, one-to-many) raises μ_req or makes small
S infeasible.

Where this differs from the paper's reconstructed rule (docs/design.md §3; ``paper_required_rate``):
T_bcast + κR/μ ≤ κ·T_train, i.e. μ ≥ κR/(κ·T_train − T_bcast). That rule assumes the κR rollouts of a window
are generated only after its snapshot arrived. echo2's workers keep generating with the version they hold
while the next one streams in (the relay runs beside the engine; the agent applies between batches), and the
buffer admits those rollouts as long as their lag is ≤ S; so generation overlaps dissemination, and the
requirement is the rate R/T_train as soon as the window (S − κ + 1)·T_train − L is at least one step, where
the paper's rule still asks for κ/(κ − T_bcast/T_train) times more. Conversely, its schedule (generate the
window's κR rollouts with version p after p arrives, consume them in the next window) consumes version-p
rollouts up to 2κ − 1 steps after p: with the default κ = S − 1 that exceeds S once S ≥ 4, which the
admission rule (docs/design.md §1) forbids, so there the rule is not sufficient (paper example: R = 512,
T_train = 60 s, T_bcast = 120 s, S = 4, κ = 3: the rule asks 25.6 rollouts/s; here the window is empty and the
learner must wait whatever μ). The paper's rule also omits T_load and T_batch; here they delay usability like T_bcast.

Queued dissemination. If T_bcast > κ·T_step, rounds run back to back (each sends the newest published
version when it starts): versions reach workers every T_bcast seconds, not every κ steps, and each round
carries a version that was current when the round started, T_bcast + T_load + T_batch before it is usable.
The closed form above does not see that and is optimistic there; ``predict`` then takes T_step from the
round map (``queued_step_time_s``; ``mean_step_s`` decides which applies): the same assumptions, with rounds
made explicit. Round j starts at s_j = max(end of round j−1, publication of the first version newer than
round j−1's) and carries v_j, the newest version published by s_j; v_j is usable from s_j + L. Rollouts are
produced at rate μ in step order; step t's R rollouts start once some version ≥ t − S is usable (the dispatch
cap, buffer.worth_dispatching) and the previous step's are done, and step t trains once its rollouts are done
and step t−1 has trained.
The map is iterated to its periodic orbit and T_step is the mean over the second half. Where rounds do not
queue it gives the closed form's T_step (a test checks), except for κ > 1 with R/μ > T_train, where the
closed form counts one R/μ per window although all κ·R rollouts must follow the version (the map is right
there, and is used); where rounds queue, it follows the simulator.

What it says, in the limit that matters (κ = 1, R/μ small): each round's version arrives while the learner
waits, and unlocks a burst of steps up to v_j + S. The round that starts during a burst samples the learner
mid-burst; with c = ⌊(T_bcast − T_load − T_batch − R/μ) / T_train⌋ the steps of a burst done by then,
v_{j+1} − v_{j−1} = S + 1 − max(0, (v_{j−1} − v_{j−2}) − c): about (S + 1)/2 steps per round if bursts
finish in time, (S + 1 + c)/3 if not (the simulator's S = 1, 2, 4 at T_bcast = 67 s, T_train = 30 s: 1,
4/3, 2 steps per round), never more than T_bcast/T_train. Each unit of S then buys only a third to a half of
a step per round, so a faster broadcast (fewer, closer or better-linked workers) is the stronger lever.

Assumptions: steady state; aggregate throughput μ is available to any step's window (workers are
interchangeable and the dispatcher keeps them busy; the in-flight cap (S+1)·R never binds before the rate
does); T_train, T_bcast, T_load, μ_i constant; generation is continuous (batches only enter through T_batch).

Dissemination time (``bcast_time_s``) per relay topology (``broadcast.sender.topology``: the relay's own names;
the broadcast options' names ``one_to_many`` and ``pipelined`` are accepted for star and chain), for snapshot M
over links with per-worker downlink/uplink B_i and learner uplink B_L, one-way latency ℓ and ``piece`` bytes
forwarded at a time (broadcast/relay.py):
  star:     max(N·M / B_L, max_i M / B_i) + ℓ                 (one-to-many: the learner's uplink carries N copies)
  chain:    M / min(B_L, B_i, up_i) + N·(ℓ + piece / B)      (each byte crosses each link once)
  tree(f):  M / min(B_L / f, B_i, up_i / f) + depth·(ℓ + piece / B)   (f = fanout: inner nodes upload f copies)
  stripes(s): M / min(B_L, B_i, up_i) + depth_s·(ℓ + s·piece / B)   (s stripes, each down its own tree of
            fanout s; every peer uploads each byte once: broadcast/topology.py)
  auto:     the least of chain and stripes(s) for s = 2..4: what broadcast.sender.topology=auto (pipelined's
            default) picks from (topology.choose, which keeps the chain unless stripes save 5 % of M/B: this
            envelope is optimistic by at most that)
with a goodput factor (0.956: TCP over MTU 1500 on a wire-rate shaper) on every rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from echo2.broadcast.topology import FANOUT, MAX_STRIPES, PIECE_BYTES, levels

GOODPUT = 1448 / 1514  # TCP payload per wire byte at MTU 1500: what an HTB-shaped link (or a real one) carries
# The relay's topology names (broadcast.sender.topology), and the broadcast options' names for two of them.
TOPOLOGIES = {"chain": "chain", "tree": "tree", "star": "star", "stripes": "stripes", "auto": "auto",
              "pipelined": "auto", "one_to_many": "star"}


@dataclass(frozen=True)
class WorkerLink:
    """One worker's network as the model sees it: Mbit/s down and up, round-trip time to the learner (ms).
    (The relay's emulated access link for tests is echo2.lab.link.Link.)"""

    down_mbit: float
    up_mbit: float
    rtt_ms: float = 0.0


def bcast_time_s(mode: str, snapshot_bytes: float, learner_uplink_mbit: float, workers: int, down_mbit: float,
                 up_mbit: float, rtt_ms: float, fanout: int = FANOUT, goodput: float = GOODPUT) -> float:
    """Seconds until the last of ``workers`` holds the snapshot, given the slowest downlink and uplink among them
    and the longest RTT (see the module doc for each formula). Depends on the active set only through these
    four numbers, and grows as any of them gets worse: what exact activation relies on."""
    topology = topology_of(mode)
    if workers <= 0:
        return 0.0
    rates = (learner_uplink_mbit, down_mbit, up_mbit)
    if not all(math.isfinite(r) and r > 0 for r in rates) or not (math.isfinite(rtt_ms) and rtt_ms >= 0):
        raise ValueError(f"link rates must be finite and > 0 Mbit/s and the RTT finite and >= 0 ms, got learner "
                         f"uplink {learner_uplink_mbit}, down {down_mbit}, up {up_mbit}, rtt {rtt_ms}")
    rate = lambda mbit: mbit * 1e6 / 8 * goodput  # noqa: E731  bytes/s of payload
    latency_s = rtt_ms / 2e3
    if topology == "star":
        return max(workers * snapshot_bytes / rate(learner_uplink_mbit), snapshot_bytes / rate(down_mbit)) + latency_s
    # every relay's uplink counts (conservative: the chain's last uploads nothing)
    relay_mbit = min(learner_uplink_mbit, down_mbit, up_mbit if workers > 1 else math.inf)
    chain_s = snapshot_bytes / rate(relay_mbit) + workers * (latency_s + PIECE_BYTES / rate(relay_mbit))
    if topology == "chain":
        return chain_s

    def striped_s(s: int) -> float:  # s stripes at 1/s of the rate each: every hop waits s pieces
        hop_s = latency_s + s * PIECE_BYTES / rate(relay_mbit)
        return snapshot_bytes / rate(relay_mbit) + levels(workers, s) * hop_s

    if topology == "stripes":
        return striped_s(max(2, fanout))
    if topology == "auto":  # each term is monotone in N, the rates and the RTT, so their least is too
        return min([chain_s] + [striped_s(s) for s in range(2, MAX_STRIPES + 1)])
    bottleneck = min(learner_uplink_mbit / fanout, down_mbit, up_mbit / fanout if workers > 1 else math.inf)
    return snapshot_bytes / rate(bottleneck) + levels(workers, fanout) * (latency_s + PIECE_BYTES / rate(bottleneck))


def topology_of(mode: str) -> str:
    """The relay topology (auto, chain, tree, stripes, star) a broadcast mode names; raises on anything else."""
    if mode not in TOPOLOGIES:
        raise ValueError(f"broadcast topology {mode!r}: expected one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[mode]


def links_bcast_time_s(mode: str, snapshot_bytes: float, learner_uplink_mbit: float, links: list[WorkerLink],
                       fanout: int = FANOUT) -> float:
    if not links:
        return 0.0
    return bcast_time_s(mode, snapshot_bytes, learner_uplink_mbit, len(links), min(x.down_mbit for x in links),
                        min(x.up_mbit for x in links), max(x.rtt_ms for x in links), fanout)


@dataclass(frozen=True)
class Prediction:
    feasible: bool  # can the learner be kept fully busy at all (given S, κ, L)?
    required_rollouts_per_s: float  # μ_req (inf when not feasible)
    aggregate_rollouts_per_s: float  # μ of the active set
    utilization: float  # T_train / T_step
    step_s: float  # T_step
    idle_s: float  # learner wait per step
    usable_after_s: float  # L = T_bcast + T_load + T_batch
    window_steps: int  # S − κ + 1
    queued: bool = False  # T_bcast > κ·T_step: rounds queue; T_step comes from the round map (module doc)


def predict(rollouts_per_step: float, train_step_s: float, staleness: int, interval: int, bcast_s: float,
            load_s: float, worker_rollouts_per_s: list[float], batch_s: float = 0.0) -> Prediction:
    """The model of the module doc for one active set (its throughputs) and one dissemination time."""
    if not 1 <= interval <= staleness + 1:
        raise ValueError(f"interval κ={interval} needs 1 <= κ <= S+1 (S={staleness})")
    R, T, mu = float(rollouts_per_step), float(train_step_s), float(sum(worker_rollouts_per_s))
    L = bcast_s + load_s + batch_s
    k = staleness - interval + 1
    room = k * T - L
    feasible = room > 0
    required = R / min(T, room) if feasible else math.inf
    if mu <= 0:
        return Prediction(feasible, required, 0.0, 0.0, math.inf, math.inf, L, k)
    closed = float(step_time_s(R, T, k, L, mu, interval))
    step = float(mean_step_s(R, T, staleness, interval, bcast_s, load_s + batch_s, mu)[0])
    return Prediction(feasible, required, mu, T / step, step, step - T, L, k, bcast_s > interval * closed)


def mean_step_s(rollouts_per_step: float, train_step_s: float, staleness: int, interval: int, bcast_s,
                after_bcast_s: float, mu) -> np.ndarray:
    """T_step for each aggregate throughput in ``mu``: the closed form where it holds, the round map where rounds
    queue (T_bcast > κ·T_step; the closed form's T_step is a lower bound, so testing with it is safe) or where κ > 1
    and R/μ > T_train (a window with no room must generate all κ·R rollouts after its version is usable, which
    the closed form counts once). Elsewhere the two agree (tests/planning/test_activation.py)."""
    mu = np.atleast_1d(np.asarray(mu, dtype=float))
    bcast_s = np.broadcast_to(np.asarray(bcast_s, dtype=float), mu.shape)
    k = staleness - interval + 1
    step = np.asarray(step_time_s(rollouts_per_step, train_step_s, k, bcast_s + after_bcast_s, mu, interval), float)
    step = np.broadcast_to(step, mu.shape).copy()
    hard = (bcast_s > interval * step) | ((interval > 1) & (rollouts_per_step > mu * train_step_s))
    if hard.any():
        step[hard] = queued_step_time_s(rollouts_per_step, train_step_s, staleness, interval, bcast_s[hard],
                                        after_bcast_s, mu[hard])
    return step


def step_time_s(rollouts_per_step: float, train_step_s: float, window_steps: int, usable_after_s, mu,
                interval: int = 1):
    """Mean T_step (see the module doc); numpy-friendly in μ and L."""
    gen = rollouts_per_step / np.maximum(mu, 1e-300)
    waits = np.floor(np.maximum(window_steps, 0) / interval) + 1  # block starts sharing the wait for one version
    idle = np.maximum(0.0, (gen + usable_after_s - window_steps * train_step_s) / waits)
    return np.maximum(train_step_s + idle / interval, gen)


def queued_step_time_s(rollouts_per_step: float, train_step_s: float, staleness: int, interval: int,
                       bcast_s, after_bcast_s, mu, steps: int = 240) -> np.ndarray:
    """Mean T_step from the round map of the module doc, for each aggregate throughput in ``mu`` (and T_bcast, if an
    array; vectorised: the exact activation solver prices thousands of sets at once). ``after_bcast_s`` =
    T_load + T_batch. Averaging over the second half of ``steps`` steps is within ~2 % of the long-run mean
    (checked against 1,500 steps)."""
    R, T, S, k = float(rollouts_per_step), float(train_step_s), int(staleness), int(interval)
    mu = np.atleast_1d(np.asarray(mu, dtype=float))
    bcast_s = np.broadcast_to(np.asarray(bcast_s, dtype=float), mu.shape)
    after_bcast_s = np.broadcast_to(np.asarray(after_bcast_s, dtype=float), mu.shape)
    cols = np.arange(mu.size)
    gen = R / np.maximum(mu, 1e-300)
    ends = np.full((steps + 1, mu.size), np.inf)  # when step t's training ends (version t + 1 is published)
    usable = np.full((steps + 1, mu.size), np.inf)  # round i's version: when usable, and which
    version = np.full((steps + 1, mu.size), steps + S + 1, dtype=np.int64)  # (a sentinel above any need)
    usable[0], version[0] = 0.0, 0  # every worker starts with version 0
    rounds = np.ones(mu.size, dtype=np.int64)
    first = np.zeros(mu.size, dtype=np.int64)  # the first round whose version the current step may use
    done = np.zeros(mu.size, dtype=np.int64)  # steps trained by the latest round's start
    round_end, produced, trained = np.zeros(mu.size), np.zeros(mu.size), np.zeros(mu.size)
    for t in range(steps):
        # Start the rounds step t waits for. Computing a round only when needed is exact: it starts before the
        # version that unblocks step t is usable, so every step done by then is already in ``ends``.
        while (late := version[rounds - 1, cols] < t - S).any():
            i = cols[late]
            first_new = (version[rounds[i] - 1, i] // k + 1) * k  # ≤ t, as κ ≤ S + 1
            start = np.maximum(round_end[i], ends[first_new - 1, i])
            while (more := ends[done[i], i] <= start).any():  # round starts only move forward: count on
                done[i[more]] += 1
            round_end[i] = start + bcast_s[i]
            usable[rounds[i], i], version[rounds[i], i] = round_end[i] + after_bcast_s[i], done[i] // k * k
            rounds[i] += 1
        while (old := version[first, cols] < t - S).any():
            first[old] += 1
        produced = np.maximum(produced, usable[first, cols]) + gen
        trained = np.maximum(trained, produced) + T
        ends[t] = trained
    half = steps // 2
    return (ends[steps - 1] - ends[half - 1]) / (steps - half)


def paper_required_rate(rollouts_per_step: float, train_step_s: float, interval: int, bcast_s: float) -> float:
    """The reconstructed ECHO-2 rule (docs/design.md §3): κR / (κ·T_train − T_bcast); inf when
    κ·T_train ≤ T_bcast."""
    room = interval * train_step_s - bcast_s
    return interval * rollouts_per_step / room if room > 0 else math.inf
