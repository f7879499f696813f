"""The policy's weights at its last few versions, kept on the CPU for the rollout checks (echo2/coordinator/trust.py).

A worker reports the logprob its weights (version x) gave each token; the learner, at version t, checks it. Scored
with the learner's current weights, an honest worker's tokens at lag t - x carry what the learner has learnt since
x: on the tiny model at learning rate 3e-3 the RMS log-ratio of lag-2 tokens went above 2 nats (the default bound
b) in 9 steps of 600, and one such checked batch could retire a run's only honest worker as untrusted (a CI run's
hostile soak did). Scored with the weights of version x itself, an honest worker's tokens differ from the learner's
only by numerics, whatever the lag and the learning rate, and a forger gains nothing by claiming an older version.

Only the versions a check will ask for are kept: a check runs at the steps that are multiples of
``check_every_steps``, and asks for the versions up to ``lags`` (the staleness bound S) behind it, so at most S
copies of the weights are held (of a LoRA policy, of its adapter), in host memory, and copied only on the steps
before a check. Under ZeRO-3, whose
parameters are partitioned across processes, none is kept: lagged tokens are then scored with the current weights.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


def trained(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters training changes: all of them, or a LoRA adapter's alone (its frozen base never moves, so a
    past version is its adapter)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class PastPolicies:
    def __init__(self, lags: int, every: int):
        """``lags``: the most versions a checked rollout may lag (S); ``every``: the learner checks the batches of
        the steps that are multiples of it (0: never, and nothing is kept)."""
        self.lags, self.every = max(lags, 0), every
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.unavailable: str | None = None  # why no weights can be kept (said once)

    def needed(self, version: int) -> bool:
        """Whether a check will score tokens of ``version`` at a later version: the next check step after it is at
        most ``lags`` versions ahead."""
        if not self.every or not self.lags:
            return False
        return (version // self.every + 1) * self.every - version <= self.lags

    def record(self, version: int, model: torch.nn.Module) -> None:
        """Called with each new version (and the one a run starts or resumes at): keep a copy if a check will need
        it; forget those no check can ask for any more."""
        for old in [v for v in self.kept if v < version - self.lags]:
            del self.kept[old]
        if not self.needed(version) or self.unavailable:
            return
        params = trained(model)
        if any(p.numel() == 0 or hasattr(p, "ds_id") for p in params.values()):
            self.unavailable = "the parameters are partitioned (ZeRO-3)"
            log.warning("rollout checks: %s, so lagged tokens are scored with the current weights (what the learner "
                        "learnt since counts against a worker)", self.unavailable)
            return
        self.kept[version] = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}

    @contextmanager
    def swapping(self, model: torch.nn.Module):
        """Inside the block, ``load(version)`` (a kept one) puts that version's weights into ``model``; after it,
        the model has its own again, also when the block raises. The live weights are copied aside once, however
        many versions are loaded."""
        params = trained(model)

        def put(weights: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])

        own = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        try:
            yield lambda version: put(self.kept[version])
        finally:
            put(own)
