"""A staleness-aware learning rate (``learner.lr_staleness=inverse``): each optimizer step's rate is scaled by

    factor = min(1, (1 + lr_ref_lag) / (1 + lag)),   lag = the mean policy lag of the step's batch

Why: with rollouts Δ versions old the GRPO surrogate gradient is biased by O(Δ·η) (arXiv 2607.01083, which asks
for η ≪ R_batch / (S·G_upd)); scaling η by 1/(1 + Δ) keeps Δ·η about constant, at the bias of a batch lag
``lr_ref_lag`` old trained at the configured rate. The measured lag, not the bound S, sets it: a run at S = 8
whose workers keep up trains on fresh data at full speed, and pays only when its batches really are old. The
``+ 1`` keeps on-policy batches (lag 0) from being sped up. The scheduler's own rate is reset every step, so the
factor multiplies it and is never compounded; it is logged as ``train/lr_staleness_factor``.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from echo2.metrics import TRAIN_LR_STALENESS_FACTOR


def lr_factor(lag: float, ref_lag: float) -> float:
    return min(1.0, (1.0 + ref_lag) / (1.0 + max(lag, 0.0)))


class StalenessLR(TrainerCallback):
    def __init__(self, trainer: Any, ref_lag: float):
        self.trainer, self.ref_lag = trainer, ref_lag

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """After the step's gradients, before the optimizer applies them: the batch's lag is known (its
        ``buffer/staleness_mean``, recorded when the batch was taken; with ``learner.num_iterations`` > 1 every pass
        over the batch uses that lag)."""
        metrics = self.trainer._metrics["train"]
        factor = lr_factor(self.trainer.batch_lag_mean, self.ref_lag)
        for group in (optimizer or self.trainer.optimizer).param_groups:
            group["lr"] = group["lr"] * factor
        metrics[TRAIN_LR_STALENESS_FACTOR].append(factor)
