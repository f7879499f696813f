"""The sample-completions table: what the policy writes, every ``run.completions_every_steps`` steps.

TRL's ``log_completions`` prints and logs every completion of a logging step (prompt, completion, each reward,
advantage). echo2's table adds where each rollout came from and how old it was, which is what an asynchronous run
needs to read: one row per rollout of the step's batch (its first ``run.completions_rows`` rollouts, so whole
groups come first), with the columns ``COLUMNS`` and then each reward function's value. Rows go to
``<run dir>/completions.jsonl`` (one JSON line each, with its step) and, as a table named ``completions``, to every
tracker of ``run.report_to`` (metrics.MetricsSink.completions). Only steps that train on a new batch are tabled
(with ``learner.num_iterations`` > 1 the later passes reuse it): the first such step of each window of N steps.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from echo2.learner.distributed import ShardedSource
from echo2.records import RolloutGroup

COLUMNS = ["step", "prompt", "completion", "reward", "worker", "lag", "group"]


def prompt_text(prompt: Any) -> str:
    """A prompt as a reader wants it: the string, or chat messages one per line as ``role: content``."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)


def completion_rows(groups: list[RolloutGroup], step: int, batch_version: int, limit: int) -> tuple[list, list]:
    """(columns, rows) of the table for the batch ``groups`` taken at ``batch_version`` and trained at ``step``."""
    names = list(groups[0].rollouts[0].rewards) if groups and groups[0].rollouts else []
    rows = []
    for g in groups:
        for r in g.rollouts:
            if len(rows) == limit:
                return COLUMNS + names, rows
            rows.append([step, prompt_text(g.row.get("prompt", "")), r.text, r.reward, g.worker_id or "learner",
                         batch_version - r.version, g.group_id, *(r.rewards.get(n) for n in names)])
    return COLUMNS + names, rows


class CompletionsTable(TrainerCallback):
    """Writes the table through the run's MetricsSink (rank 0; ``sink`` None elsewhere)."""

    def __init__(self, trainer: Any, sink: Any, every_steps: int, limit: int):
        self.trainer, self.sink, self.every_steps, self.limit = trainer, sink, every_steps, limit
        self.last_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.sink is None or not self.every_steps or not state.is_world_process_zero:
            return
        step = state.global_step
        if step != self.trainer.batch_version + 1:  # a later pass over the batch already tabled (or not)
            return
        if self.last_step is not None and step // self.every_steps <= self.last_step // self.every_steps:
            return
        source = self.trainer.rollout_source
        groups = source.last_batch if isinstance(source, ShardedSource) else self.trainer.last_groups
        if not groups:
            return
        columns, rows = completion_rows(groups, step, self.trainer.batch_version, self.limit)
        self.sink.completions(step, columns, rows)
        self.last_step = step
