"""echo2: GRPO post-training with a central learner and remote rollouts.

    python train.py                                   # tiny model, copy task, 2 local vLLM workers, S=2
    python train.py task.level=mod10 run.steps=400    # any key, from the command line
    python train.py -m seed=0,1,2                     # a sweep: one run directory per job
    launchers/learner.sh 2 learner=zero2 rollout=sync # DeepSpeed ZeRO-2 over 2 processes

Reads like the algorithm: compose config -> build model, task, rollout source, learner -> train -> summary.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from echo2.config import register_configs, validate
from echo2.env import configure_process, run_token, world

log = logging.getLogger("echo2")
register_configs()


def build(cfg: DictConfig, run_dir: str, rank: int, world_size: int):
    """Build every component from the config, one log line each. Returns (trainer, source, callback)."""
    from transformers import AutoTokenizer

    from echo2.learner.args import grpo_config
    from echo2.learner.callbacks import Echo2Callback
    from echo2.learner.trainer import Echo2GRPOTrainer
    from echo2.metrics import MetricsSink
    from echo2.rollout.evaluate import Evaluator
    from echo2.rollout.protocols import RolloutContext
    from echo2.rollout.scoring import Scorer
    from echo2.rollout.types import SamplingParams

    model_path = instantiate(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    log.info("model %s from %s (%s)", cfg.model.name, model_path, cfg.model.dtype)

    task = instantiate(cfg.task)
    train_set = task.train_dataset()
    log.info("task %s: %d train rows, max %d completion tokens", task.name, len(train_set),
             task.max_completion_length)

    engine = instantiate(cfg.rollout.engine, pad_token_id=tokenizer.pad_token_id,
                         eos_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingParams(n=cfg.rollout.group_size, max_tokens=task.max_completion_length,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k)
    token, token_origin = run_token()
    ctx = RolloutContext(task=task, tokenizer=tokenizer, scorer=Scorer(task, tokenizer), sampling=sampling,
                         engine=engine, model_path=model_path, run_dir=run_dir, seed=cfg.seed,
                         staleness=cfg.rollout.staleness, prompts_per_step=cfg.rollout.prompts_per_step,
                         make_broadcaster=instantiate(cfg.broadcast.sender, token=token, _partial_=True),
                         pool=instantiate(cfg.pool),
                         publish_interval=cfg.broadcast.interval, token=token,
                         activation={**OmegaConf.to_container(cfg.activation), "interval": cfg.broadcast.interval,
                                     "broadcast": _mode(cfg.broadcast.sender.get("topology", "chain"))})
    source = instantiate(cfg.rollout.source, ctx=ctx)
    log.info("rollout source %s: S=%d, R=%d x %d per step, token %s", type(source).__name__,
             cfg.rollout.staleness, cfg.rollout.prompts_per_step, cfg.rollout.group_size, token_origin)

    trainer = Echo2GRPOTrainer(model=model_path, processing_class=tokenizer, reward_funcs=task.reward_funcs(),
                               args=grpo_config(cfg, run_dir, world_size), train_dataset=train_set,
                               rollout_source=source, correction=cfg.rollout.correction,
                               is_bounds=(cfg.rollout.is_min, cfg.rollout.is_max))
    log.info("learner %s on %d process(es): %s", type(trainer).__name__, world_size, trainer.backend())

    sink = None
    if rank == 0:
        sink = MetricsSink(run_dir, cfg.run.wandb, cfg.run.project, cfg.run.group, cfg.run.name,
                           OmegaConf.to_container(cfg, resolve=True))
    evaluator = Evaluator(task, tokenizer, engine) if cfg.run.eval_every_steps else None
    callback = Echo2Callback(trainer, sink, evaluator, cfg.run.eval_every_steps, cfg.run.progress)
    trainer.add_callback(callback)
    return trainer, source, callback


def _mode(topology: str) -> str:
    """The capacity model's name for a relay topology."""
    return {"chain": "pipelined", "star": "one_to_many"}.get(topology, topology)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    configure_process()
    rank, world_size = world()
    if rank:  # one voice: the other ranks log warnings only
        logging.getLogger().setLevel(logging.WARNING)
    validate(cfg, world_size)
    run_dir = HydraConfig.get().runtime.output_dir
    if rank == 0:
        OmegaConf.save(cfg, os.path.join(run_dir, "resolved_config.yaml"), resolve=True)
    trainer, source, callback = build(cfg, run_dir, rank, world_size)

    # SIGTERM (a scheduler's stop, `kill`) unwinds like Ctrl-C, so the finally below stops the workers.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        accounting = source.close()
    summary = callback.summary(wall_s=time.perf_counter() - t0, learner_backend=trainer.backend(),
                               learner_processes=world_size, rollouts_consumed=trainer.rollouts_consumed,
                               rollout_accounting=accounting)
    evals = summary["eval_accuracy_by_step"]
    log.info("done: %d steps in %.1f s (%s x %d); reward %.3f at step 1 -> %.3f over the last 20; "
             "eval accuracy %s; run dir %s", summary["steps"], summary["wall_s"], summary["learner_backend"],
             world_size, summary["reward_first"], summary["reward_last20_mean"],
             " -> ".join(f"{a:.3f}@{s}" for s, a in evals.items()) or "off", run_dir)
    return summary


if __name__ == "__main__":
    main()
