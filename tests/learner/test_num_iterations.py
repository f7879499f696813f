"""learner.num_iterations = μ > 1 is TRL's num_iterations: μ optimizer steps over one batch, the "old" logprobs kept.

The reference is TRL's own GRPOTrainer on the same batch: echo2's sync learner generates and trains a batch at
μ = 2; TRL is handed exactly that batch (its rollout_func returns echo2's token ids) and trains with the same
settings. The two must log the same loss at both steps and end with the same weights. Plain SGD: AdamW's first
update is lr·g/|g|, so float noise in a near-zero gradient would flip whole updates and hide whether they agree.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer  # here, at collection: TRL's first import probes the platform (processes)

from conftest import build_run
from echo2.coordinator.buffer import worth_dispatching

SHRUNK = ["rollout.prompts_per_step=8"]  # R = 8 x 8 = 64 rollouts: a quick step, still groups that differ


def echo2_run(tmp_path, mu: int, steps: int, extra=()):
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", f"learner.num_iterations={mu}", f"run.steps={steps}",
                                                   "+learner.trl.optim=sgd", "learner.learning_rate=0.05",
                                                   "learner.max_grad_norm=1e9", "run.save_every_steps=0", *SHRUNK,
                                                   *extra])
    batches = []

    def keep(rows, version, policy=None, _collect=source.collect):
        groups = _collect(rows, version, policy)
        batches.append((version, groups))
        return groups

    source.collect = keep
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return cfg, trainer, batches, losses


def trl_run(tiny_model_dir, cfg, groups, mu: int, out_dir):
    """TRL's GRPOTrainer trained on ``groups`` (one batch) for μ steps, with echo2's settings."""
    from datasets import Dataset
    from hydra.utils import instantiate

    task = instantiate(cfg.task)
    rows = [dict(g.row) for g in groups]
    by_prompt: dict[str, deque] = defaultdict(deque)
    for g in groups:
        by_prompt[g.row["prompt"]].append(g)

    def rollout_func(prompts, trainer):
        """echo2's groups, in the order TRL's sampler put their prompts (each repeated G times in a row)."""
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for start in range(0, len(prompts), cfg.rollout.group_size):
            group = by_prompt[prompts[start]].popleft()
            for r in group.rollouts:
                out["prompt_ids"].append(r.prompt_ids)
                out["completion_ids"].append(r.completion.token_ids)
                out["logprobs"].append(r.completion.logprobs)
        return out

    args = GRPOConfig(
        output_dir=str(out_dir), seed=cfg.seed, max_steps=mu, num_iterations=mu,
        per_device_train_batch_size=len(rows) * cfg.rollout.group_size, gradient_accumulation_steps=1,
        num_generations=cfg.rollout.group_size, max_completion_length=cfg.task.max_completion_length,
        temperature=cfg.rollout.temperature, learning_rate=cfg.learner.learning_rate, optim="sgd",
        lr_scheduler_type=cfg.learner.lr_scheduler_type, weight_decay=0.0, max_grad_norm=1e9,
        loss_type=cfg.learner.loss_type, beta=0.0, epsilon=cfg.learner.epsilon, scale_rewards=cfg.learner.scale_rewards,
        bf16=False, gradient_checkpointing=False, use_cpu=True, model_init_kwargs={"dtype": "float32"},
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=task.reward_funcs(), args=args,
                          train_dataset=Dataset.from_list(rows), rollout_func=rollout_func)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(not q for q in by_prompt.values()), "TRL did not train on every group of the batch"
    return before, after, losses


def test_two_passes_match_trls_num_iterations(tmp_path, tiny_model_dir):
    """μ = 2: one batch, two optimizer steps; the same losses and the same final weights as TRL's num_iterations=2
    (TRL recomputes the old logprobs with the weights at the batch's start; echo2's sync source returns them with
    the batch, equal to within the engine's float noise), and both steps moved the weights."""
    cfg, trainer, batches, losses = echo2_run(tmp_path / "echo2", mu=2, steps=2)
    assert [v for v, _ in batches] == [0] and trainer.version == 2, "μ = 2: one batch (at version 0), two versions"
    assert trainer.rollouts_consumed == 64
    echo2_after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    before, trl_after, trl_losses = trl_run(tiny_model_dir, cfg, batches[0][1], mu=2, out_dir=tmp_path / "trl")
    assert (trl_after - before).abs().max() > 1e-4, "TRL's steps did not move the weights: nothing compared"
    assert len(losses) == len(trl_losses) == 2
    assert losses == pytest.approx(trl_losses, rel=1e-4, abs=1e-6), (losses, trl_losses)
    assert losses[0] != losses[1], "the second pass saw the same weights as the first"
    torch.testing.assert_close(echo2_after, trl_after, rtol=1e-4, atol=1e-6)


def test_one_batch_per_mu_steps_and_the_log_follows(tmp_path):
    """μ = 2 over 4 steps: batches are taken at versions 0 and 2, each logged once as consumed and once in the
    completions table; the steps between carry no batch metrics of their own (as in TRL's logs)."""
    from conftest import read_jsonl

    cfg, trainer, batches, losses = echo2_run(tmp_path, mu=2, steps=4, extra=["run.completions_every_steps=1"])
    assert [v for v, _ in batches] == [0, 2] and trainer.version == 4 and len(losses) == 4
    records = [h for h in trainer.state.log_history if "loss" in h]
    assert ["reward/mean" in r for r in records] == [True, False, True, False]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert trainer.rollouts_consumed == 2 * 64
    assert [r["step"] for r in read_jsonl(tmp_path / "consumed.jsonl")] == [1, 3]
    table = read_jsonl(tmp_path / "completions.jsonl")
    assert sorted({r["step"] for r in table}) == [1, 3] and {r["lag"] for r in table} == {0}


@pytest.mark.parametrize("step, worker, ahead, P, S, mu, worth", [
    (4, 4, 0, 2, 0, 1, True),    # the next batch, from the newest weights
    (4, 4, 2, 2, 0, 1, False),   # a batch later: one version stale at S=0
    (4, 4, 2, 2, 1, 1, True),    # ... admissible at S=1
    (4, 4, 2, 2, 1, 2, False),   # μ=2: a batch later is two versions later
    (4, 4, 2, 2, 2, 2, True),    # ... admissible at S=2
    (4, 3, 2, 2, 3, 2, True),    # a worker one version behind, S=3
    (4, 3, 4, 2, 3, 2, False),   # two batches later: 4 + 2*2 - 3 = 5 > 3
])
def test_dispatch_counts_mu_versions_per_batch(step, worker, ahead, P, S, mu, worth):
    """The coordinator dispatches a group only if it can still be admissible when consumed; a batch is taken
    every μ versions, so a group `ahead // P` batches back in the queue is consumed μ·(ahead // P) versions on."""
    assert worth_dispatching(step, worker, ahead, P, S, mu) == worth


def test_a_resume_between_batches_takes_the_same_next_batch(tmp_path):
    """μ = 2, a checkpoint at step 2 (between batches): resumed from it, the learner takes its next batch at version
    2 from the same prompts as the run that was not interrupted, and counts the rollouts of the batches before."""
    import train
    from conftest import compose

    common = ["rollout=sync", "learner.num_iterations=2", "run.steps=4", "run.save_every_steps=2", *SHRUNK,
              "run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0"]

    def run(run_dir, resume=None):
        cfg = compose(common)
        trainer, source, _ = train.build(cfg, str(run_dir), rank=0, world_size=1, resume=resume)
        taken = []

        def keep(rows, version, policy=None, _collect=source.collect):
            taken.append((version, [r["prompt"] for r in rows]))
            return _collect(rows, version, policy)

        source.collect = keep
        trainer.train(resume_from_checkpoint=resume)
        return trainer, taken

    whole, taken = run(tmp_path / "whole")
    assert [v for v, _ in taken] == [0, 2]
    checkpoint = tmp_path / "whole" / "trainer" / "checkpoint-2"
    assert (checkpoint / "echo2_state.json").is_file()
    resumed, taken_again = run(tmp_path / "whole", resume=str(checkpoint))
    assert taken_again == [taken[1]], "the resumed run did not take the same batch at version 2"
    assert resumed.version == 4 and resumed.rollouts_consumed == whole.rollouts_consumed == 2 * 64
