"""What a worker claims cannot break the learner: behaviour logprobs are bounded against the learner's before any
ratio is taken (rollout.max_log_ratio), and a step whose loss or gradient is not finite is skipped, never applied."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from conftest import WrappedSource, build_run
from echo2.learner.corrections import bound_log_ratio
from echo2.learner.trainer import Echo2GRPOTrainer  # noqa: F401  (TRL and DeepSpeed ask `uname` once, at import)
from echo2.metrics import ROLLOUT_BOUNDED_TOKENS, TRAIN_SKIPPED_STEPS


class Forged(WrappedSource):
    """A stub source: the sync source's rollouts, the first token of the first rollout claimed at ``logprob``."""

    def __init__(self, inner, logprob):
        super().__init__(inner)
        self.logprob = logprob

    def collect(self, rows, version, policy=None):
        groups = self.inner.collect(rows, version, policy)
        groups[0].rollouts[0].completion.logprobs[0] = self.logprob
        return groups


def weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


def step_with(tmp_path, logprob, overrides=()):
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=1", *overrides])
    trainer.rollout_source = Forged(source, logprob)
    before = weights(trainer)
    trainer.train()
    record = next(h for h in trainer.state.log_history if ROLLOUT_BOUNDED_TOKENS in h)
    return before, weights(trainer), record


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_one_forged_logprob_leaves_every_weight_finite(tmp_path, correction):
    """A behaviour logprob of -1000 is finite, so a push carrying it is valid; the learner's ratio against it would
    be exp(+1000) = inf, and inf x advantage 0 = NaN in every weight. Bounded, the step trains (weights move, all
    finite) and the one bounded token is counted."""
    before, after, record = step_with(tmp_path, -1000.0, [f"rollout.correction={correction}"])
    assert torch.isfinite(after).all(), f"{(~torch.isfinite(after)).sum()} of {after.numel()} weights not finite"
    assert not torch.equal(before, after)
    assert record[ROLLOUT_BOUNDED_TOKENS] == 1.0 and record[TRAIN_SKIPPED_STEPS] == 0.0


def test_honest_logprobs_are_not_bounded(tmp_path):
    """On-policy (S=0, the learner's own engine) nothing is near the bound: the exactness of the loss holds."""
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=2"])
    trainer.train()
    counts = [h[ROLLOUT_BOUNDED_TOKENS] for h in trainer.state.log_history if ROLLOUT_BOUNDED_TOKENS in h]
    assert counts == [0.0, 0.0]


def test_a_step_with_a_non_finite_gradient_is_skipped(tmp_path, caplog):
    """A NaN in one gradient (here put there by a hook: any cause) must not reach the optimizer: the weights and
    the optimizer's state stay as they were, the step is counted and said; the next step trains."""
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=2"])
    param = next(trainer.model.parameters())
    hook = param.register_hook(lambda g: g * math.nan)
    from transformers import TrainerCallback

    seen = {}

    class AfterFirst(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                seen["weights"] = weights(trainer)
                seen["optimizer_state"] = len(trainer.optimizer.state)
                hook.remove()

    trainer.add_callback(AfterFirst())
    before = weights(trainer)
    with caplog.at_level(logging.WARNING, logger="echo2.learner.trainer"):
        trainer.train()
    assert torch.equal(seen["weights"], before), "the step with a NaN gradient changed the weights"
    assert seen["optimizer_state"] == 0, "the skipped step still updated the optimizer's moments"
    after = weights(trainer)
    assert torch.isfinite(after).all() and not torch.equal(after, before)  # the next step trained
    skipped = [h[TRAIN_SKIPPED_STEPS] for h in trainer.state.log_history if TRAIN_SKIPPED_STEPS in h]
    assert skipped == [1.0, 1.0]  # cumulative
    assert any("skipped" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("learner, behaviour, bounded, count", [
    (-1.0, -1.0, -1.0, 0),  # agrees: untouched, bit for bit
    (-1.0, -5.9, -5.9, 0),  # 4.9 nats: within 5
    (-1.0, -1000.0, -6.0, 1),  # claimed far below: clamped to the learner's - 5
    (-30.0, -1.0, -25.0, 1),  # claimed far above: clamped to the learner's + 5
    (-1.0, math.nan, -1.0, 1),  # not a number: the learner's own (ratio 1)
    (-1.0, -math.inf, -6.0, 1),
    (-1.0, 6.0, 4.0, 1),  # a logprob above 0 is impossible; bounded like any other: -1 + 5
])
def test_bound_log_ratio(learner, behaviour, bounded, count):
    out, n = bound_log_ratio(torch.tensor([[learner]]), torch.tensor([[behaviour]]), 5.0,
                             torch.ones(1, 1, dtype=torch.long))
    assert out.item() == pytest.approx(bounded) and n.item() == count


def test_bound_log_ratio_counts_real_tokens_only():
    learner = torch.zeros(2, 3)
    behaviour = torch.tensor([[-100.0, 0.0, -100.0], [-100.0, -100.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out, n = bound_log_ratio(learner, behaviour, 5.0, mask)
    assert n.item() == 2  # the padding is bounded too (its ratio must be finite) but not counted
    assert torch.equal(out, torch.tensor([[-5.0, 0.0, -5.0], [-5.0, -5.0, 0.0]]))


@pytest.mark.e2e
@pytest.mark.slow
def test_under_zero2_every_rank_skips_a_step_one_rank_made_non_finite(tmp_path):
    """Two ZeRO-2 processes: a forged logprob on rank 0 leaves every weight finite, and a NaN gradient on rank 0
    alone is skipped on both ranks (a non-finite gradient norm is global), counted by the learner on each."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29000 + os.getpid() % 900), str(ROOT / "tests" / "scripts" / "zero2_finite_step.py"),
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert result["backend"] == "deepspeed-zero2"
        assert result["step1_finite"] and result["step1_moved"], result
        assert result["step2_unchanged"] and result["step2_finite"], result
        assert [r[TRAIN_SKIPPED_STEPS] for r in result["records"]] == [0.0, 1.0], result
        assert result["records"][0][ROLLOUT_BOUNDED_TOKENS] == 1.0, result
