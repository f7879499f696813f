"""echo2: GRPO post-training with a central learner and remote rollouts.

    python train.py                                   # tiny model, copy task, 2 local vLLM workers, S=2
    python train.py task.level=mod10 run.steps=400    # any key, from the command line
    python train.py -m seed=0,1,2                     # a sweep: one run directory per job
    python train.py hydra.run.dir=RUN_DIR             # resumes from RUN_DIR's newest checkpoint, if any
    launchers/learner.sh 2 learner=zero3              # DeepSpeed ZeRO-3 over 2 processes, remote workers

Reads like the algorithm: compose config -> build model, task, rollout source, learner -> train -> summary.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from echo2.config import ConfigError, check_experiments, check_overrides, register_configs, validate
from echo2.config_checks import sweep_warning
from echo2.env import configure_process, run_token, world
from echo2.seams import RunParts, RunStopped

log = logging.getLogger("echo2")
register_configs()


def find_checkpoint(cfg: DictConfig, run_dir: str) -> str | None:
    """The checkpoint to resume from (run.resume): ``auto``, the newest complete one in the run dir (one whose
    echo2 state was written: a run killed mid-save falls back to the one before); ``never``; or a path."""
    from echo2.learner.callbacks import CHECKPOINT_STATE, complete_checkpoints

    choice = str(cfg.run.resume)
    if choice == "never":
        return None
    if choice != "auto":
        if not (Path(choice) / CHECKPOINT_STATE).is_file():
            raise FileNotFoundError(f"run.resume={choice}: not an echo2 checkpoint (no {CHECKPOINT_STATE} in it)")
        return choice
    complete = complete_checkpoints(Path(run_dir, "trainer"))
    return str(complete[-1]) if complete else None


def build(cfg: DictConfig, run_dir: str, rank: int, world_size: int, resume: str | None = None):
    """Build every component from the config, one log line each. Returns (trainer, source, step_log): step_log
    writes the summary, and its ``stop`` ends the run after a step. ``resume``: a checkpoint to resume from
    (find_checkpoint); the trainer loads it in ``train()``."""
    from echo2.learner.args import (free_memory_gib, grpo_config, learning_rate_warning, longest_prompt,
                                    micro_batch_advice, peft_config, resolve_precision)
    from echo2.learner import callbacks, trl_fields
    from echo2.learner.samples import CompletionsTable
    from echo2.learner.trainer import Echo2GRPOTrainer, parameter_counts
    from echo2.metrics import MetricsSink
    from echo2.models.tokenizer import load_tokenizer, stop_token_ids
    from echo2.learner.evaluate import Evaluator

    resolve_precision(cfg)
    trl = OmegaConf.to_container(cfg.learner.trl, resolve=True) if cfg.learner.trl else {}
    task = instantiate(cfg.task)
    train_set = task.train_dataset()
    log.info("task %s: %d train rows, max %d completion tokens", task.name, len(train_set),
             task.max_completion_length)
    reward_weights(task, trl.get("reward_weights"))

    model_path = instantiate(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    stop_ids = stop_token_ids(tokenizer, model_path)
    if extra := [i for i in trl_fields.extra_stop_ids(trl) if i not in stop_ids]:  # learner.trl.generation_kwargs
        if max(extra) >= len(tokenizer):
            raise ConfigError(f"learner.trl.generation_kwargs: stop token {max(extra)} is not in the vocabulary "
                              f"({len(tokenizer)} tokens)")
        stop_ids = [*stop_ids, *extra]
    log.info("model %s from %s (%s), stop tokens %s", cfg.model.name, model_path, cfg.model.dtype,
             tokenizer.convert_ids_to_tokens(stop_ids))
    if warning := learning_rate_warning(cfg):
        log.warning("%s", warning)

    engine = instantiate(cfg.rollout.engine, pad_token_id=tokenizer.pad_token_id, eos_token_ids=stop_ids)
    resumed = json.loads((Path(resume) / callbacks.CHECKPOINT_STATE).read_text()) if resume else None
    if resumed:
        log.info("resuming from %s (step %d)", resume, resumed["step"])
    source = build_source(cfg, task, tokenizer, engine, model_path, run_dir, rank, world_size, resumed, stop_ids)

    from echo2.tasks.rewards import environment_reward

    # TRL's trainer wants a reward source; a task scored by its environment alone has its reward there
    trainer = Echo2GRPOTrainer(model=model_path, processing_class=tokenizer,
                               reward_funcs=task.reward_funcs() or [environment_reward],
                               args=grpo_config(cfg, run_dir, world_size), train_dataset=train_set,
                               peft_config=peft_config(cfg),
                               rollout_source=source, staleness=cfg.rollout.staleness,
                               correction=cfg.rollout.correction,
                               is_bounds=(cfg.rollout.is_min, cfg.rollout.is_max),
                               icepop_bounds=(cfg.rollout.icepop_min, cfg.rollout.icepop_max),
                               m2_threshold=cfg.rollout.m2_threshold,
                               seq_bounds=(cfg.rollout.seq_min, cfg.rollout.seq_max),
                               max_log_ratio=cfg.rollout.max_log_ratio)
    log.info("learner %s on %d process(es): %s, %s, weights %s%s%s", type(trainer).__name__, world_size,
             trainer.backend(), trainer.accelerator.device, next(trainer.model.parameters()).dtype,
             ", bf16 compute with fp32 master weights" if trainer.args.bf16 else "", trainer.describe_adapter())
    trained, _ = parameter_counts(trainer.model)
    free = free_memory_gib(trainer.accelerator.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if rank == 0 and (advice := micro_batch_advice(cfg, world_size, trainer.model.config, free,
                                                   longest_prompt(task, tokenizer, train_set), trained)):
        log.warning(advice)
    if cfg.learner.lr_staleness == "inverse":
        from echo2.learner.staleness_lr import StalenessLR

        trainer.add_callback(StalenessLR(trainer, cfg.learner.lr_ref_lag))
        log.info("staleness-aware learning rate: x min(1, (1 + %g) / (1 + batch lag))", cfg.learner.lr_ref_lag)

    sink = None
    if rank == 0:
        group, name = wandb_names(cfg)
        sink = MetricsSink(run_dir, cfg.run.wandb, cfg.run.project, group, name,
                           OmegaConf.to_container(cfg, resolve=True), resume_step=resumed["step"] if resumed else None,
                           report_to=cfg.run.report_to, tags=list(cfg.run.tags))
    on_workers = cfg.run.eval_on == "workers"
    evaluator = Evaluator(task, tokenizer, engine) if cfg.run.eval_every_steps and not on_workers else None
    stop = callbacks.StopOnSignal(trainer)
    evaluation = callbacks.Evaluation(trainer, evaluator, cfg.run.eval_every_steps, sink.previous if sink else [],
                                      on_workers=on_workers and bool(cfg.run.eval_every_steps))
    step_log = callbacks.StepLog(trainer, sink, evaluation, stop)
    table = CompletionsTable(trainer, sink, cfg.run.completions_every_steps, cfg.run.completions_rows)
    for callback in (callbacks.SourceVersions(trainer, cfg.run.keep_checkpoints), stop, evaluation, step_log, table):
        trainer.add_callback(callback)
    if cfg.run.progress:
        trainer.add_callback(callbacks.ProgressBar(step_log))
    return trainer, source, step_log


def build_source(cfg: DictConfig, task: Any, tokenizer: Any, engine: Any, model_path: str, run_dir: str, rank: int,
                 world_size: int, resumed: dict | None, stop_ids: list[int]) -> Any:
    """The rollout source the config names. With several learner processes and remote workers, rank 0 alone owns
    it (its coordinator, pool and broadcaster) and hands every rank its slice (ShardedSource)."""
    from echo2.activation.settings import BroadcastShape
    from echo2.learner.distributed import ShardedSource
    from echo2.scoring import Scorer
    from echo2.records import SamplingParams

    sampling = SamplingParams(n=cfg.rollout.group_size, max_tokens=task.max_completion_length,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, stop_token_ids=tuple(stop_ids))
    token, token_origin = run_token()
    # reward functions read trainer_state.max_steps and .epoch (epochs: P rows a step, over the training rows)
    scorer = Scorer(task, tokenizer, max_steps=cfg.run.steps,
                    steps_per_epoch=len(task.train_dataset()) / cfg.rollout.prompts_per_step)
    parts = RunParts(task=task, tokenizer=tokenizer, scorer=scorer, sampling=sampling, engine=engine,
                     model_path=model_path, run_dir=run_dir, seed=cfg.seed, staleness=cfg.rollout.staleness,
                     prompts_per_step=cfg.rollout.prompts_per_step, publish_interval=cfg.broadcast.interval, token=token,
                     # built in the coordinator's process, which hands it the token (it derives the relay key and
                     # the manifest-signing key from it)
                     broadcaster=OmegaConf.to_container(cfg.broadcast.sender, resolve=True),
                     pool=instantiate(cfg.pool), activation=OmegaConf.to_object(cfg.activation),
                     broadcast_shape=BroadcastShape.of(cfg.broadcast),
                     resume=resumed["source"] if resumed and resumed["source"] else None, max_steps=cfg.run.steps,
                     steps_per_batch=cfg.learner.num_iterations,
                     worker_eval_every_steps=cfg.run.eval_every_steps if cfg.run.eval_on == "workers" else 0)
    if get_class(cfg.rollout.source._target_).needs_policy:  # generates in this process: every rank its own slice
        source = make_source(cfg.rollout.source, parts)
    else:  # remote workers
        source = ShardedSource(make_source(cfg.rollout.source, parts) if rank == 0 else None, rank, world_size)
    log.info("rollout source %s: S=%d, R=%d x %d per step, token %s", cfg.rollout.source._target_.rpartition(".")[2],
             cfg.rollout.staleness, cfg.rollout.prompts_per_step, cfg.rollout.group_size, token_origin)
    return source


def reward_weights(task: Any, weights: list[float] | None) -> None:
    """``learner.trl.reward_weights``, TRL's name: the weights of the task's reward functions, in their order, for
    every scorer of the run (the task is handed, weights and all, to the coordinator's reward processes)."""
    if weights is None:
        return
    names = [f.__name__ for f in task.reward_funcs()]
    if len(weights) != len(names):
        raise ConfigError(f"learner.trl.reward_weights={list(weights)}: task {task.name} has {len(names)} reward "
                          f"function(s) ({', '.join(names)}), so give {len(names)} weight(s), in that order")
    task.reward_weights_override = [float(w) for w in weights]
    log.info("reward weights %s", ", ".join(f"{n}={w:g}" for n, w in zip(names, weights)))


def make_source(node: DictConfig, parts: RunParts) -> Any:
    """The rollout source ``node`` names, built from the run's ``parts`` and its options from the config."""
    return instantiate(node, _partial_=True)(parts)


def wandb_names(cfg: DictConfig) -> tuple[str | None, str | None]:
    """wandb group and run name: ``run.group`` / ``run.name`` if set; in a sweep (``-m``) the sweep's directory
    names the group and each job is named by its values of the swept keys (``broadcast=one_to_many,
    rollout.staleness=2``), so a sweep's runs sit together and say what differs."""
    group, name = cfg.run.group, cfg.run.name
    try:
        hc = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests)
        return group, name
    from hydra.types import RunMode

    if hc.mode == RunMode.MULTIRUN:
        sweep = Path(hc.sweep.dir)
        group = group or f"{sweep.parent.name}_{sweep.name}"
        axes = _swept_keys(sys.argv[1:])
        own = sorted(o for o in hc.overrides.task if axes and o.split("=", 1)[0].lstrip("+~") in axes)
        name = name or ",".join(own) or hc.job.override_dirname or f"job{hc.job.num}"
    return group, name


def _swept_keys(argv: list[str]) -> set[str]:
    """The keys a ``-m`` command line sweeps (``a=1,2``, ``range(...)``...); empty where the job was not started
    from that command line (e.g. a submitit job, which then falls back on all of its overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    except Exception:
        return set()
    return {o.key_or_group for o in overrides if o.is_sweep_override()}


def check(cfg: DictConfig, run_dir: str, world_size: int) -> str | None:
    """Every check that needs no model, before anything loads; returns the checkpoint to resume from. A failure is
    a configuration error: logged (the console and <run dir>/train.log), then exit 1, without a traceback."""
    from echo2.learner.args import check_launch, resolve_precision
    from echo2.learner.outputs import check_hub

    try:
        resolve_precision(cfg)  # model.dtype=auto, learner.bf16=null: what this machine runs
        check_launch(cfg, world_size)  # before DeepSpeed: no launcher, N not dividing P, micro-batches, precision
        validate(cfg, world_size)
        check_hub(cfg)  # run.push_to_hub: a token and a hub that answers, before hours of training
        return find_checkpoint(cfg, run_dir)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        config_error(e)


def config_error(e: BaseException):
    log.error("%s", e)
    raise SystemExit(1) from None


STARTED = False  # main() was entered: a failure before it is Hydra's (composition)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    global STARTED
    STARTED = True
    configure_process()
    rank, world_size = world()
    if rank:  # one voice: the other ranks log warnings only
        logging.getLogger().setLevel(logging.WARNING)
    if warning := sweep_warning(HydraConfig.get()):
        log.warning("%s", warning)
    run_dir = HydraConfig.get().runtime.output_dir
    checkpoint = check(cfg, run_dir, world_size)
    if rank == 0:
        OmegaConf.save(cfg, os.path.join(run_dir, "resolved_config.yaml"), resolve=True)
    try:
        trainer, source, step_log = build(cfg, run_dir, rank, world_size, resume=checkpoint)
    except ConfigError as e:  # what only the task or model could tell (reward weights, stop tokens)
        config_error(e)
    stop = step_log.stop

    # The first SIGTERM (a scheduler's stop or preemption, `kill`) or Ctrl-C ends the run after the current step,
    # with a checkpoint (if run.save_every_steps) and the summary; a second one unwinds at once. Either way the
    # finally below stops the workers.
    def on_stop(signum, frame):
        if stop.requested:
            signal.default_int_handler(signum, frame)
        stop.requested = signal.Signals(signum).name
        source.request_stop()  # a step still waiting for workers or rollouts ends now, without training
        log.warning("%s: stopping after this step (again to stop now)", stop.requested)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    t0 = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except RunStopped as e:
        log.warning("%s; the run ends after %d steps", e, trainer.state.global_step)
    finally:
        accounting = source.close()
    from echo2.learner.outputs import HubError, push, save_final

    final = save_final(trainer)  # always: run.save_every_steps only decides the resumable checkpoints
    summary = step_log.summary(wall_s=time.perf_counter() - t0, learner_backend=trainer.backend(),
                               learner_processes=world_size, rollouts_consumed=trainer.rollouts_consumed,
                               rollout_accounting=accounting, final_model=final)
    if rank == 0:
        from echo2.report import load, summary_table

        print(summary_table(summary, load(run_dir)["records"]), flush=True)
    evals = summary["eval_accuracy_by_step"]
    num = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731 (no step: no reward)
    log.info("done: %d steps in %.1f s (%s x %d); reward %s at step 1 -> %s over the last 20; "
             "eval accuracy %s; run dir %s", summary["steps"], summary["wall_s"], summary["learner_backend"],
             world_size, num(summary["reward_first"]), num(summary["reward_last20_mean"]),
             " -> ".join(f"{a:.3f}@{s}" for s, a in evals.items()) or "off", run_dir)
    try:
        push(trainer, cfg)
    except HubError as e:
        config_error(e)
    if world_size > 1:  # accelerate's own end: the process group torn down while the interpreter is whole
        trainer.accelerator.end_training()
    return summary


if __name__ == "__main__":
    # before Hydra: its message would suggest adding the key with +, or name a mistyped key without a near one
    if bad := check_overrides(sys.argv[1:]) + check_experiments(sys.argv[1:]):
        sys.exit("invalid setting:\n  " + "\n  ".join(bad))
    try:
        main()
    except SystemExit as e:
        if e.code and not STARTED:  # Hydra could not compose the config: it printed why; the run dir keeps it too
            from echo2.config_checks import log_composition_error

            log_composition_error(sys.argv[1:])
        raise
