"""Map echo2's config onto TRL's ``GRPOConfig``: the one place learner settings meet TRL's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from trl import GRPOConfig


def grpo_config(cfg: Any, run_dir: str | Path, world_size: int) -> GRPOConfig:
    lc, rc = cfg.learner, cfg.rollout
    rollouts_per_step = rc.prompts_per_step * rc.group_size
    extra = OmegaConf.to_container(lc.trl, resolve=True) if lc.trl else {}
    deepspeed = OmegaConf.to_container(lc.deepspeed, resolve=True) if lc.deepspeed else None
    return GRPOConfig(
        output_dir=str(Path(run_dir) / "trainer"),
        seed=cfg.seed,
        max_steps=cfg.run.steps,
        # One optimizer step per R = P·G rollouts, split evenly over the learner processes.
        per_device_train_batch_size=rollouts_per_step // world_size,
        num_generations=rc.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=cfg.task.max_completion_length,
        temperature=rc.temperature,  # the learner's logprobs must use the sampling temperature
        learning_rate=lc.learning_rate,
        lr_scheduler_type=lc.lr_scheduler_type,
        warmup_steps=lc.warmup_steps,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.max_grad_norm,
        loss_type=lc.loss_type,
        beta=lc.beta,
        epsilon=lc.epsilon,
        epsilon_high=lc.epsilon_high,
        scale_rewards=lc.scale_rewards,
        mask_truncated_completions=lc.mask_truncated_completions,
        bf16=lc.bf16,
        gradient_checkpointing=lc.gradient_checkpointing,
        deepspeed=deepspeed,
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs={"dtype": cfg.model.dtype},
        logging_steps=1,
        report_to="none",  # echo2's MetricsSink owns wandb, with namespaced keys
        save_strategy="steps" if cfg.run.save_every_steps else "no",
        save_steps=cfg.run.save_every_steps or 500,
        save_total_limit=cfg.run.keep_checkpoints,
        disable_tqdm=True,  # echo2's own progress bar
        log_completions=False,
        **extra,
    )
