"""Trainer callbacks: per-step metrics record, publishing versions to the source, evaluation, progress bar.

Order within one learner step (HF Trainer): optimizer step → ``on_step_end`` (publish version, maybe
evaluate) → TRL's ``log`` (averages its metrics) → ``on_log`` (write one record for the step).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import TrainerCallback

from echo2.metrics import MetricsSink, namespaced

log = logging.getLogger(__name__)

CHECKPOINT_STATE = "echo2_state.json"  # what on_save adds to TRL's checkpoint; train.py resumes only where it is


class Echo2Callback(TrainerCallback):
    def __init__(self, trainer: Any, sink: MetricsSink | None, evaluator: Any = None, eval_every_steps: int = 0,
                 progress: bool = True):
        self.trainer, self.sink, self.evaluator = trainer, sink, evaluator
        self.eval_every_steps, self.progress = eval_every_steps, progress
        self.bar: tqdm | None = None
        self.t0 = 0.0
        self.pending: dict[str, float] = {}
        self.evals: list[tuple[int, float]] = []
        self.rewards: list[float] = []
        self.stop_requested: str | None = None  # set by train.py's signal handler: end after this step
        for record in sink.previous if sink is not None else []:  # a resumed run's summary covers the whole run
            self.rewards.append(record.get("reward/mean", float("nan")))
            if record.get("eval/accuracy") is not None:
                self.evals.append((record["step"], record["eval/accuracy"]))

    def _evaluate(self, step: int) -> None:
        if self.evaluator is None:
            return
        with self.trainer.live_policy() as policy:
            result = self.evaluator(policy)
        self.pending.update(result)
        self.evals.append((step, result["eval/accuracy"]))

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step:  # resumed from a checkpoint: weights, optimizer, RNG and step are restored
            self.trainer.rollouts_consumed = state.global_step * (args.per_device_train_batch_size
                                                                      * args.gradient_accumulation_steps * args.world_size)
            self.trainer.rollout_source.on_resume(state.global_step, self.trainer.weights())
        else:
            self._evaluate(0)
            self.pending.clear()  # the step-0 accuracy lives in summary.json; records start at step 1
        if state.is_world_process_zero and self.progress:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step",
                            dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.rollout_source.on_version(state.global_step, self.trainer.weights())
        batch = getattr(self.trainer.rollout_source, "last_batch", None) or self.trainer.last_groups  # all ranks'
        if self.sink is not None and state.is_world_process_zero and batch:
            self.sink.consumed(state.global_step, batch)
        if args.world_size > 1:  # a signal to any rank stops every rank after the same step (no rank left waiting)
            import torch

            flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.trainer.accelerator.device)
            if self.trainer.accelerator.reduce(flag, reduction="sum").item() and not self.stop_requested:
                self.stop_requested = "stopped by another learner rank"
        if self.stop_requested:
            control.should_training_stop = True
            control.should_save = bool(args.save_strategy != "no")
        if self.eval_every_steps and (state.global_step % self.eval_every_steps == 0
                                      or state.global_step == state.max_steps):
            self._evaluate(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # train_runtime summary at the end, not a step
            return
        record = {"step": state.global_step, "version": self.trainer.version,
                  "time_s": time.perf_counter() - self.t0, **namespaced(logs), **self.pending}
        self.pending.clear()
        self.rewards.append(record.get("reward/mean", float("nan")))
        if self.sink is not None and state.is_world_process_zero:
            self.sink.log(record)
        if self.bar is not None:
            self.bar.set_postfix(progress_fields(record, self.evals), refresh=False)
            self.bar.update(state.global_step - self.bar.n)

    def on_save(self, args, state, control, **kwargs):
        """After TRL saved weights, optimizer, scheduler, RNG and step: add what the rollout plane needs. A
        checkpoint without this file is incomplete and is not resumed from."""
        source_state = self.trainer.rollout_source.checkpoint()
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / CHECKPOINT_STATE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": state.global_step, "source": source_state}) + "\n")
            tmp.replace(path)
            log.info("checkpoint %s", path.parent)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()

    def summary(self, **extra) -> dict:
        """End-of-run summary: written to ``summary.json`` (rank 0) and returned."""
        tail = [r for r in self.rewards[-20:] if r == r]
        out = {
            "steps": self.trainer.state.global_step,
            "stopped_by": self.stop_requested,
            **extra,
            "reward_first": self.rewards[0] if self.rewards else None,
            "reward_last20_mean": sum(tail) / len(tail) if tail else None,
            "eval_accuracy_by_step": {str(s): a for s, a in self.evals},
        }
        if self.sink is not None:
            self.sink.summary(out)
            self.sink.close()
        return out


def progress_fields(record: dict[str, Any], evals: list[tuple[int, float]]) -> dict[str, str]:
    """The progress bar's fields: reward, mean lag of the batch, learner utilization, dollars, eval accuracy."""
    out = {"reward": f"{record.get('reward/mean', float('nan')):.3f}"}
    if record.get("buffer/staleness_mean") is not None:
        out["lag"] = f"{record['buffer/staleness_mean']:.1f}"
    if record.get("train/learner_utilization") is not None:
        out["util"] = f"{record['train/learner_utilization']:.2f}"
    if record.get("cost/usd") is not None:
        out["$"] = f"{record['cost/usd']:.4f}"
    if evals:
        out["eval"] = f"{evals[-1][1]:.3f}"
    return out
