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
Step t may consume rollouts from versions x ≥ t − S (DESIGN §2). Only every κ-th version is published, so in
the worst phase the oldest usable published version is p = t − S + κ − 1, usable from p·T_step + L; step t's
R rollouts must be ready when its compute starts, at t·T_step + I. Its generation window is therefore

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

Where this differs from the paper's reconstructed rule (DESIGN §4, ``paper_required_rate``):
T_bcast + κR/μ ≤ κ·T_train, i.e. μ ≥ κR/(κ·T_train − T_bcast). That rule assumes the κR rollouts of a window
are generated only after its snapshot arrived. echo2's workers keep generating with the version they hold
while the next one streams in (the relay runs beside the engine; the agent applies between batches), and the
buffer admits those rollouts as long as their lag is ≤ S; so generation overlaps dissemination, and the
requirement is the rate R/T_train as soon as the window (S − κ + 1)·T_train − L is at least one step, where
the paper's rule still asks for κ/(κ − T_bcast/T_train) times more. Conversely, its schedule (generate the
window's κR rollouts with version p after p arrives, consume them in the next window) consumes version-p
rollouts up to 2κ − 1 steps after p: with the default κ = S − 1 that exceeds S once S ≥ 4, which DESIGN §2's
admission rule forbids, so there the rule is not sufficient (paper example: R = 512, T_train = 60 s,
T_bcast = 120 s, S = 4, κ = 3: the rule asks 25.6 rollouts/s; here the window is empty and the learner must
wait whatever μ). The paper's rule also omits T_load and T_batch; here they delay usability like T_bcast.

Queued dissemination. If T_bcast > κ·T_step, rounds run back to back (each sends the latest version): versions
reach workers every T_bcast seconds, not every κ steps, and a round starts on a version already up to κ·T_step
old. The model above does not capture that and is then optimistic (``Prediction.queued`` says so); in the
simulator the learner then advances about (S + 1)/2 steps per round (BENCHMARKS.md, capacity validation).

Assumptions: steady state; aggregate throughput μ is available to any step's window (workers are
interchangeable and the dispatcher keeps them busy; the in-flight cap (S+1)·R never binds before the rate
does); T_train, T_bcast, T_load, μ_i constant; rounds of dissemination never queue behind each other
(T_bcast ≤ κ·T_step; otherwise versions are skipped and L grows).

Dissemination time (``bcast_time_s``) per mode, for snapshot M over links with per-worker downlink/uplink B_i
and learner uplink B_L, one-way latency ℓ and ``piece`` bytes forwarded at a time (relay.py):
  one_to_many:  max(N·M / B_L, max_i M / B_i) + ℓ                 (the learner's uplink carries N copies)
  pipelined:    M / min(B_L, B_i, up_i) + N·(ℓ + piece / B)      (chain: each byte crosses each link once)
  tree(f):      M / min(B_L / f, B_i, up_i / f) + depth·(ℓ + piece / B)   (inner nodes upload f copies)
with a goodput factor (0.956: TCP over MTU 1500 on a wire-rate shaper) on every rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GOODPUT = 1448 / 1514  # TCP payload per wire byte at MTU 1500: what an HTB-shaped link (or a real one) carries
PIECE_BYTES = 256 << 10  # echo2.broadcast.relay.PIECE_BYTES: the cut-through granularity


@dataclass(frozen=True)
class Link:
    """One worker's network: Mbit/s down and up, round-trip time to the learner (ms)."""

    down_mbit: float
    up_mbit: float
    rtt_ms: float = 0.0


def bcast_time_s(mode: str, snapshot_bytes: float, learner_uplink_mbit: float, workers: int, down_mbit: float,
                 up_mbit: float, rtt_ms: float, fanout: int = 2, goodput: float = GOODPUT) -> float:
    """Seconds until the last of ``workers`` holds the snapshot, given the slowest downlink and uplink among them
    and the longest RTT (see the module doc for each formula). Depends on the active set only through these
    four numbers, and grows as any of them gets worse: what exact activation relies on."""
    if workers <= 0:
        return 0.0
    rate = lambda mbit: mbit * 1e6 / 8 * goodput  # noqa: E731  bytes/s of payload
    latency_s = rtt_ms / 2e3
    if mode == "one_to_many":
        return max(workers * snapshot_bytes / rate(learner_uplink_mbit), snapshot_bytes / rate(down_mbit)) + latency_s
    if mode == "pipelined":  # every relay's uplink counts (conservative: the chain's last uploads nothing)
        bottleneck = min(learner_uplink_mbit, down_mbit, up_mbit if workers > 1 else math.inf)
        return snapshot_bytes / rate(bottleneck) + workers * (latency_s + PIECE_BYTES / rate(bottleneck))
    if mode == "tree":
        depth = math.ceil(math.log(workers * (fanout - 1) + 1, fanout)) if fanout > 1 else workers
        bottleneck = min(learner_uplink_mbit / fanout, down_mbit, up_mbit / fanout if workers > 1 else math.inf)
        return snapshot_bytes / rate(bottleneck) + depth * (latency_s + PIECE_BYTES / rate(bottleneck))
    raise ValueError(f"broadcast mode {mode!r}: expected one_to_many, pipelined or tree")


def links_bcast_time_s(mode: str, snapshot_bytes: float, learner_uplink_mbit: float, links: list[Link],
                       fanout: int = 2) -> float:
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
    queued: bool = False  # T_bcast > κ·T_step: rounds queue, the model is optimistic (see the module doc)


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
    step = float(step_time_s(R, T, k, L, mu, interval))
    return Prediction(feasible, required, mu, T / step, step, step - T, L, k, bcast_s > interval * step)


def step_time_s(rollouts_per_step: float, train_step_s: float, window_steps: int, usable_after_s, mu,
                interval: int = 1):
    """Mean T_step (see the module doc); numpy-friendly in μ and L."""
    gen = rollouts_per_step / np.maximum(mu, 1e-300)
    waits = np.floor(np.maximum(window_steps, 0) / interval) + 1  # block starts sharing the wait for one version
    idle = np.maximum(0.0, (gen + usable_after_s - window_steps * train_step_s) / waits)
    return np.maximum(train_step_s + idle / interval, gen)


def paper_required_rate(rollouts_per_step: float, train_step_s: float, interval: int, bcast_s: float) -> float:
    """The reconstructed ECHO-2 rule (DESIGN §4): κR / (κ·T_train − T_bcast); inf when κ·T_train ≤ T_bcast."""
    room = interval * train_step_s - bcast_s
    return interval * rollouts_per_step / room if room > 0 else math.inf
