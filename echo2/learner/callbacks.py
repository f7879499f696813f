"""Trainer callbacks, one job each; train.py adds them in this order, which is the order they run in:

    SourceVersions  the rollout source's side of the learner: resume, a new version after every optimizer step
                    (where snapshots are published), its checkpoint state next to TRL's, and the rotation of
                    checkpoints once the new one is complete
    StopOnSignal    the first SIGTERM / Ctrl-C (train.py's handler) ends the run after the current step, on every rank
    Evaluation      eval accuracy at step 0 and every run.eval_every_steps, carried into the next step's record (with
                    run.eval_on=workers: the workers' results as they come back, the last one waited for at the end)
    StepLog         one record per step (metrics.jsonl, wandb), the consumed groups (consumed.jsonl), the summary
    ProgressBar     the tqdm bar and its fields

Order within one learner step (HF Trainer): optimizer step → ``on_step_end`` (publish version, stop?, maybe
evaluate, log consumed groups) → TRL's ``log`` (averages its metrics) → ``on_log`` (write the step's record, then
the bar shows it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import TrainerCallback

from echo2.learner.distributed import ShardedSource
from echo2.learner.evaluate import eval_due
from echo2.metrics import (BUFFER_STALENESS_MEAN, COST_USD, EVAL_ACCURACY, EVAL_TIME_S, EVAL_VERSION, REWARD_MEAN,
                           TRAIN_LEARNER_UTILIZATION, MetricsSink, namespaced)

log = logging.getLogger(__name__)

CHECKPOINT_STATE = "echo2_state.json"  # what SourceVersions adds to TRL's checkpoint; train.py resumes only where it is


def checkpoints_to_remove(found: dict[int, bool], keep: int) -> list[int]:
    """Steps of the checkpoints to delete, given every checkpoint's step and whether it is complete (holds
    CHECKPOINT_STATE): all but the ``keep`` newest complete ones. Called once a new checkpoint is complete, so
    the newest complete one is never removed and there is always one to resume from; an incomplete one (a run
    killed while saving it) is never resumed from (train.find_checkpoint) and goes too."""
    complete = sorted((step for step, done in found.items() if done), reverse=True)
    kept = set(complete[:max(keep, 1)])
    return sorted(step for step in found if step not in kept)


def checkpoint_dirs(output_dir: Path) -> dict[int, Path]:
    """Every ``checkpoint-<step>`` folder in ``output_dir``, by step."""
    return {int(p.name.rpartition("-")[2]): p for p in output_dir.glob("checkpoint-*")
            if p.name.rpartition("-")[2].isdigit()}


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders whose echo2 state was written (a save cut short has none), oldest first."""
    return [p for _, p in sorted(checkpoint_dirs(output_dir).items()) if (p / CHECKPOINT_STATE).is_file()]


def kept_source_states(output_dir: Path, keep: int | None) -> list[dict[str, Any]] | None:
    """What the rollout source saved in each checkpoint a resume may still use once the next one is saved: the
    newest ``keep`` complete ones now (the rotation after the next save keeps a subset of them; should that save fail,
    exactly them). None where every checkpoint is kept."""
    if not keep:
        return None
    return [json.loads((p / CHECKPOINT_STATE).read_text())["source"] for p in complete_checkpoints(output_dir)[-keep:]]


class SourceVersions(TrainerCallback):
    """Keeps the rollout source in step with the learner's versions."""

    def __init__(self, trainer: Any, keep_checkpoints: int | None = None):
        """``keep_checkpoints``: how many complete checkpoints to keep (run.keep_checkpoints; None: all)."""
        self.trainer, self.keep_checkpoints = trainer, keep_checkpoints

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.past_policies.record(state.global_step, self.trainer.model)
        if state.global_step:  # resumed from a checkpoint: weights, optimizer, RNG and step are restored
            batches = -(-state.global_step // self.trainer.num_iterations)  # μ optimizer steps per batch
            self.trainer.rollouts_consumed = batches * (args.per_device_train_batch_size
                                                        * args.gradient_accumulation_steps * args.world_size)
            self.trainer.rollout_source.on_resume(state.global_step, self.trainer.weights())

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.past_policies.record(state.global_step, self.trainer.model)
        self.trainer.rollout_source.on_version(state.global_step, self.trainer.weights())

    def on_save(self, args, state, control, **kwargs):
        """After TRL saved weights, optimizer, scheduler, RNG and step: add what the rollout plane needs. A
        checkpoint without this file is incomplete and is not resumed from."""
        kept = None  # None: every checkpoint kept, nothing may be forgotten (also where reading them failed)
        if state.is_world_process_zero:
            try:
                kept = kept_source_states(Path(args.output_dir), self.keep_checkpoints)
            except (OSError, ValueError, KeyError, TypeError) as e:  # rank 0 alone must not fail before the collective
                log.warning("could not read the kept checkpoints' states (%s): the rollout journal keeps everything", e)
        source_state = self.trainer.rollout_source.checkpoint(kept)
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / CHECKPOINT_STATE
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as f:  # on disk before it is named, and its name on disk: a crash leaves old or new
                f.write(json.dumps({"step": state.global_step, "source": source_state}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            log.info("checkpoint %s", path.parent)
            if self.keep_checkpoints:
                self._rotate(Path(args.output_dir))

    def _rotate(self, output_dir: Path) -> None:
        """Delete the checkpoints beyond the newest ``keep_checkpoints`` complete ones (HF's own rotation is off:
        it ran before this checkpoint was complete, and with one kept left none complete in between)."""
        found = checkpoint_dirs(output_dir)
        for step in checkpoints_to_remove({s: (p / CHECKPOINT_STATE).is_file() for s, p in found.items()},
                                          self.keep_checkpoints):
            shutil.rmtree(found[step], ignore_errors=True)


class StopOnSignal(TrainerCallback):
    """``requested`` (set by train.py's signal handler) ends the run after the current step (with
    ``learner.num_iterations`` = μ > 1, after the current batch's last pass), with a checkpoint where checkpoints are
    on; a signal to any rank stops every rank after the same step (none left waiting): the current one, or the next
    if the signal lands while the ranks vote at the step's end."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.requested: str | None = None  # why: the signal's name, or another rank's stop

    def on_step_end(self, args, state, control, **kwargs):
        stop = bool(self.requested)
        if args.world_size > 1:
            import torch

            # Every rank acts on the vote alone: a signal handled while this rank waits in the reduce (or after it)
            # sets ``requested`` too late for the other ranks to hear of it this step, so it counts at the next one.
            flag = torch.tensor([1.0 if stop else 0.0], device=self.trainer.accelerator.device)
            voted = bool(self.trainer.accelerator.reduce(flag, reduction="sum").item())
            if voted and not stop:
                self.requested = self.requested or "stopped by another learner rank"
            stop = voted
        # with μ passes per batch, a stop waits for the batch's last pass (checkpoints lie between batches)
        if stop and state.global_step % self.trainer.num_iterations == 0:
            control.should_training_stop = True
            control.should_save = bool(args.save_strategy != "no")


class Evaluation(TrainerCallback):
    """Runs ``evaluator(policy, step)`` at step 0 (not on a resume) and every ``every_steps`` steps and at the last one;
    its results wait in ``pending`` for the step's record, and ``results`` keeps (version, accuracy) for the run.

    ``on_workers`` (run.eval_on=workers): the rollout source has workers evaluate those versions instead
    (echo2/coordinator/evaluation.py); each step's record carries the results that came back since the previous one,
    with ``eval/version``, the version measured; the last version's result, waited for at the end of training, goes
    to the summary (``eval_accuracy_by_step``, ``eval_final``), as the step records are written by then."""

    def __init__(self, trainer: Any, evaluator: Any, every_steps: int, previous: list[dict] = (),
                 on_workers: bool = False):
        self.trainer, self.evaluator, self.every_steps, self.on_workers = trainer, evaluator, every_steps, on_workers
        self.pending: dict[str, float] = {}
        self.results = [(int(r.get(EVAL_VERSION, r["step"])), r[EVAL_ACCURACY]) for r in previous
                        if r.get(EVAL_ACCURACY) is not None]
        self.final: dict[str, float] | None = None  # on workers: the result that came back after the last record

    def _evaluate(self, step: int) -> None:
        if self.evaluator is None:
            return
        main = self.trainer.accelerator.is_main_process
        if main:  # a multi-turn task's held-out episodes can take minutes on a CPU: say what the wait is
            log.info("evaluating v%d greedily on the learner: %d held-out rows", step, len(self.evaluator.rows))
        t0 = time.perf_counter()
        with self.trainer.live_policy() as policy:
            result = {**self.evaluator(policy, step), EVAL_TIME_S: time.perf_counter() - t0}
        if main:
            log.info("v%d: held-out accuracy %.3f in %.1f s", step, result[EVAL_ACCURACY], result[EVAL_TIME_S])
        self.pending.update(result)
        self.results.append((step, result[EVAL_ACCURACY]))

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.global_step:
            self._evaluate(0)
            self.pending.clear()  # the step-0 accuracy lives in summary.json; records start at step 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.on_workers:
            if state.is_world_process_zero:
                self._received(self.trainer.rollout_source.evaluations())
        elif eval_due(state.global_step, self.every_steps, state.max_steps):
            self._evaluate(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not (self.on_workers and state.is_world_process_zero):
            return
        try:
            results = self.trainer.rollout_source.wait_for_evaluations()
        except Exception as e:  # noqa: BLE001 - the run is done; its final save must not be lost for an evaluation
            log.warning("the last evaluation on a worker did not come back: %s", e)
            return
        self._received(results)
        self.final = dict(self.pending) or None
        self.pending.clear()

    def _received(self, results: list[dict]) -> None:
        """Workers' results: the newest into ``pending`` (the next record), each into ``results``."""
        for r in results:
            self.pending.update({k: v for k, v in r.items() if k.startswith("eval/")})
            self.results.append((int(r["version"]), r[EVAL_ACCURACY]))
            log.info("eval on worker %s: accuracy %.3f at v%d (asked for %s), %.1f s", r["worker_id"],
                     r[EVAL_ACCURACY], r["version"], ", ".join(f"v{v}" for v in r["requested"]), r[EVAL_TIME_S])


class StepLog(TrainerCallback):
    """Writes one record per step to ``sink`` (rank 0; None on the others) with the step's evaluation, logs the
    step's consumed groups, and writes the run's summary. ``last`` is the newest record."""

    def __init__(self, trainer: Any, sink: MetricsSink | None, evaluation: Evaluation, stop: StopOnSignal):
        self.trainer, self.sink, self.evaluation, self.stop = trainer, sink, evaluation, stop
        self.t0 = 0.0
        self.last: dict[str, Any] | None = None
        # a resumed run's summary covers the whole run
        self.rewards = [r.get(REWARD_MEAN, float("nan")) for r in (sink.previous if sink is not None else [])]

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()  # after the step-0 evaluation

    def on_step_end(self, args, state, control, **kwargs):
        source = self.trainer.rollout_source  # the consumed log holds every rank's groups
        batch = source.last_batch if isinstance(source, ShardedSource) else self.trainer.last_groups
        new_batch = state.global_step == self.trainer.batch_version + 1  # not a later pass (μ > 1) over it
        if self.sink is not None and state.is_world_process_zero and batch and new_batch:
            self.sink.consumed(state.global_step, batch)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # train_runtime summary at the end, not a step
            self.last = None
            return
        record = {"step": state.global_step, "version": self.trainer.version,
                  "time_s": time.perf_counter() - self.t0, **namespaced(logs), **self.evaluation.pending}
        self.evaluation.pending.clear()
        self.rewards.append(record.get(REWARD_MEAN, float("nan")))
        if self.sink is not None and state.is_world_process_zero:
            self.sink.log(record)
        self.last = record

    def summary(self, **extra) -> dict:
        """End-of-run summary: written to ``summary.json`` (rank 0) and returned."""
        tail = [r for r in self.rewards[-20:] if r == r]
        out = {
            "steps": self.trainer.state.global_step,
            "stopped_by": self.stop.requested,
            **extra,
            "reward_first": self.rewards[0] if self.rewards else None,
            "reward_last20_mean": sum(tail) / len(tail) if tail else None,
            "eval_accuracy_by_step": {str(s): a for s, a in self.evaluation.results},
            **({"eval_final": self.evaluation.final} if self.evaluation.final else {}),
        }
        if self.sink is not None:
            self.sink.summary(out)
            self.sink.close()
        return out


class ProgressBar(TrainerCallback):
    """The tqdm bar on rank 0: step, and the fields of the newest record (``progress_fields``)."""

    def __init__(self, step_log: StepLog):
        self.step_log = step_log
        self.bar: tqdm | None = None
        self.fields: dict[str, str] = {}  # kept across steps without a batch of their own (μ > 1)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and self.step_log.last is not None:
            self.fields.update(progress_fields(self.step_log.last, self.step_log.evaluation.results))
            self.bar.set_postfix(self.fields, refresh=False)
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def progress_fields(record: dict[str, Any], evals: list[tuple[int, float]]) -> dict[str, str]:
    """The progress bar's fields: reward, mean lag of the batch, learner utilization, dollars, eval accuracy."""
    out = {"reward": f"{record[REWARD_MEAN]:.3f}"} if record.get(REWARD_MEAN) is not None else {}
    if record.get(BUFFER_STALENESS_MEAN) is not None:
        out["lag"] = f"{record[BUFFER_STALENESS_MEAN]:.1f}"
    if record.get(TRAIN_LEARNER_UTILIZATION) is not None:
        out["util"] = f"{record[TRAIN_LEARNER_UTILIZATION]:.2f}"
    if record.get(COST_USD) is not None:
        out["$"] = f"{record[COST_USD]:.4f}"
    if evals:
        out["eval"] = f"{evals[-1][1]:.3f}"
    return out
