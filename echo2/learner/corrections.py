"""Off-policy corrections of stale rollouts (``rollout.correction``): which tokens the decoupled loss keeps, and
with what weight.

A rollout x versions behind the learner was sampled from the behaviour policy π_b (the weights of version x); the
learner's weights now are the proximal policy π_prox. With a correction on, GRPO's clipped ratio is taken against
π_prox (echo2/learner/trainer.py, ``_decoupled``) and each token's advantage is multiplied by a weight derived from

    w = π_prox(token) / π_b(token),    log w = log π_prox − log π_b  (the per-token log-ratio)

Unweighted, a stale token pulls as if π_b were the learner's policy; weighted by w it pulls as much as the learner
would sample it (importance sampling), and the corrections below bound w's variance, each differently. A weight of
0 drops the token: it stays in the loss's token count (it teaches nothing rather than something wrong), as in TRL's
``*_mask`` modes and the M2PO objective's 1/Σ|o_i|.

    correction  level      keeps                                       weight of a kept token    TRL 1.16 counterpart
    none        -          every token; π_b is the clipped ratio's     1                         -
                           "old" policy (no decoupled loss)
    tis         token      every token                                 min(w, is_max)            token_truncate
    mask        token      is_min <= w <= is_max                       w                         token_mask
    icepop      token      icepop_min <= w <= icepop_max               w                         token_mask
    m2po        batch      all but the largest (log w)², until the     w                         -
                           batch's mean (log w)² <= m2_threshold
    seq_mask    sequence   sequences with seq_min <= exp(mean log w)   min(w, is_max)            sequence_mask
                           <= seq_max, whole

TRL (``vllm_importance_sampling_mode``, ``_clip_min``/``_clip_max``) applies the same weights to correct vLLM's
sampler against the trainer at equal weights; echo2 corrects staleness, w over versions. Where they differ:
``tis`` truncates only from above (TRL also takes a ``clip_min``); ``seq_mask`` gates on the geometric mean of a
sequence's ratios, where TRL's ``sequence_mask`` uses their product exp(Σ log w) both as the gate and as the
weight of every token (a product's bounds mean different things at different lengths; a per-token mean does not),
and weights the tokens of a kept sequence one by one, truncated as ``tis`` does.

Each step logs what the correction saw and did (trainer ``_log_correction``): ``rollout/is_ratio_mean``,
``is_ratio_max`` (raw w), ``is_log_ratio_m2`` (the batch's mean (log w)², M2PO's M2), ``is_log_ratio_m2_kept``,
``is_weight_mean``, ``is_frac_masked`` (tokens at weight 0), ``is_frac_truncated``, ``is_frac_corrected`` (either).
To compare them at the lags that matter: ``python train.py -m experiment=corrections_sweep``.

Bounded first, whatever the correction (``bound_log_ratio``): a behaviour logprob is a worker's claim, and the
learner takes exp of its difference to its own. A claim more than ``rollout.max_log_ratio`` nats from the learner's
logprob (or not a number) is clamped to that distance before any ratio is formed, and counted
(``rollout/bounded_tokens``): one claimed logprob of -1000 would otherwise give exp(+1000) = inf, and inf x an
advantage of 0 = NaN in every weight. Honest on-policy logprobs are within a rounding error of the learner's, so
nothing is bounded at S = 0 and the loss there is exactly TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CORRECTIONS = ("none", "tis", "mask", "icepop", "m2po", "seq_mask")
SCALE_REWARDS = ("group", "batch", "none")  # learner.scale_rewards: advantages' scale (trainer.group_advantages)


@dataclass(frozen=True)
class Correction:
    """``rollout.correction`` and its thresholds (conf/rollout/*.yaml documents each key and its default)."""

    mode: str = "none"
    # tis and seq_mask truncate w at is_bounds[1]; mask keeps is_bounds[0] <= w <= is_bounds[1].
    is_bounds: tuple[float, float] = (0.5, 2.0)
    # icepop keeps icepop_bounds[0] <= w <= icepop_bounds[1]: IcePop's α = 0.5, β = 5 (AReaL's, OpenRLHF's).
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    # m2po: τ, the most the batch's mean of (log w)² may be, in nats²: the M2PO paper's 0.04.
    m2_threshold: float = 0.04
    # seq_mask keeps a sequence whose geometric-mean ratio lies in [seq_bounds[0], seq_bounds[1]]: by default
    # mask's bounds, put on the per-token mean of a sequence instead of on each token.
    seq_bounds: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self):
        if self.mode not in CORRECTIONS:
            raise ValueError(f"rollout.correction={self.mode!r}: expected one of {', '.join(CORRECTIONS)}")


def bound_log_ratio(learner: torch.Tensor, behaviour: torch.Tensor, max_nats: float,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``behaviour`` logprobs clamped to within ``max_nats`` of the ``learner``'s (``[sequences, tokens]``), so that
    every ratio exp(learner − behaviour) lies in [e^−max_nats, e^max_nats]; NaN becomes the learner's own (ratio 1).
    Returns (bounded logprobs, how many real tokens (``mask``) were changed, a 0-dim tensor). Every position is
    bounded, padding too: the loss multiplies padding by a mask of 0, and inf × 0 is NaN."""
    learner = learner.detach().to(behaviour.dtype)
    claimed = torch.where(torch.isnan(behaviour), learner, behaviour)
    bounded = torch.minimum(torch.maximum(claimed, learner - max_nats), learner + max_nats)
    changed = (bounded != behaviour) & mask.bool()
    return bounded, changed.sum()


def importance_weights(log_ratio: torch.Tensor, correction: Correction, mask: torch.Tensor | None = None,
                       m2_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights of the decoupled loss from the per-token log-ratios log w = log π_prox − log π_b
    (``[sequences, tokens]``); ``mask`` marks the real tokens (default: all). A weight of 0 drops the token.

    * ``tis`` — truncated importance sampling (Espeholt et al. 2018, IMPALA's truncated ρ; for LLM RL, Yao et al.
      2025, "Your efficient RL framework secretly brings you off-policy RL training"): min(w, is_max). Bounded
      variance for some bias; no token is dropped.
    * ``mask`` — w where is_min <= w <= is_max, else 0 (rejection at the token level).
    * ``icepop`` — IcePop (Ling team, "Every Step Evolves", the Ring-1T report, arXiv 2510.18855; OpenRLHF's
      ``icepop``, AReaL's ``enable_icepop``): w where α <= w <= β, else 0, on both sides, with α = 0.5, β = 5 as
      AReaL and OpenRLHF set them. The rule is ``mask``'s with IcePop's bounds: it exists so that a run names the
      method it reproduces, and a sweep can compare those bounds with ``mask``'s.
    * ``m2po`` — M2PO's second-moment mask (Zheng, Zhao, Chen 2025, "Prosperity before collapse", arXiv
      2510.01161; AReaL's ``actor.m2_threshold``): over the batch's real tokens, drop the token with the largest
      (log w)², then the next, until the mean (log w)² of those left is at most τ = m2_threshold; keep the rest
      with weight w. Over the *batch*, not per sequence or per micro-batch: ``m2_keep`` is ``m2po_keep`` of the
      (log w)² of every learner process's real tokens, cut to this process's (``log_ratio[mask]`` order); None
      computes it from this tensor alone. M2PO's objective has no clip; echo2 keeps TRL's clip against π_prox,
      which is inactive at its one optimizer step per batch (π_θ = π_prox where the gradient is taken).
    * ``seq_mask`` — sequence-level rejection on the geometric-mean ratio (verl's ``rollout_rs`` "geometric",
      OpenRLHF's and NeMo-RL's ``seq-mask-tis``): a sequence whose exp(mean over its tokens of log w) lies outside
      [seq_min, seq_max] is dropped whole; the tokens of the others are weighted as ``tis``.
    """
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else mask.bool()
    w = torch.exp(log_ratio)
    zero = torch.zeros_like(w)
    mode = correction.mode
    if mode == "tis":
        return torch.clamp(w, max=correction.is_bounds[1])
    if mode in ("mask", "icepop"):
        lo, hi = correction.is_bounds if mode == "mask" else correction.icepop_bounds
        return torch.where((w >= lo) & (w <= hi), w, zero)
    if mode == "m2po":
        keep = m2po_keep(log_ratio[mask].square(), correction.m2_threshold) if m2_keep is None else m2_keep
        weights = w.clone()
        weights[mask] = torch.where(keep, w[mask], zero[mask])
        return weights
    if mode == "seq_mask":
        geometric = torch.exp(sequence_mean(log_ratio, mask))
        keep = (geometric >= correction.seq_bounds[0]) & (geometric <= correction.seq_bounds[1])
        return torch.where(keep.unsqueeze(1), torch.clamp(w, max=correction.is_bounds[1]), zero)
    raise ValueError(f"correction {mode!r}: importance_weights is for {', '.join(CORRECTIONS[1:])}")


def m2po_keep(squared: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which tokens of a batch M2PO keeps (bool, 1-D), given their (log w)² in the batch's order (1-D).

    M2PO drops the token with the largest (log w)², then the next, until the mean of those left is <= threshold.
    Sorted descending (v_1 >= v_2 >= ... >= v_n), dropping the k largest leaves the mean (v_{k+1} + ... + v_n) /
    (n − k): the answer is the first k where that is <= threshold (0 when the batch's mean already is; n, every
    token, when even the smallest exceeds it). Tokens tied at the cut are dropped in batch order, first come first
    dropped (a stable sort), so every learner process, holding the same gathered values, drops the same tokens.
    """
    n = squared.numel()
    keep = torch.ones(n, dtype=torch.bool, device=squared.device)
    if n == 0:
        return keep
    v, order = squared.double().sort(descending=True, stable=True)
    left = v.flip(0).cumsum(0).flip(0)  # left[k] = v[k] + ... + v[n-1]: what remains after dropping k tokens
    mean_left = left / torch.arange(n, 0, -1, dtype=v.dtype, device=v.device)
    fits = (mean_left <= threshold).nonzero()
    k = int(fits[0]) if len(fits) else n
    keep[order[:k]] = False
    return keep


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row's real tokens (``[sequences, tokens]`` → ``[sequences]``); 0 for a row without any."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1.0)
