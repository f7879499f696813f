"""Greedy accuracy on the task's held-out split: ``eval/accuracy``.

Run by the learner every ``run.eval_every_steps`` steps with its live policy, on every rank (under ZeRO-3 the
gathered weights are needed everywhere); rank 0 logs it. A multi-turn task's held-out rows are whole episodes
(greedy turns, its environment answering), scored by its reward functions from their transcripts: correct when the
task's eval column reaches its threshold (task=dataset: ``eval_reward``, ``eval_threshold``). What counts as correct
is scoring.RewardFunctions.judge_job, which the coordinator also uses when a worker evaluates instead
(``run.eval_on=workers``: echo2/coordinator/evaluation.py).
"""

from __future__ import annotations

from typing import Any

from echo2.metrics import EVAL_ACCURACY, EVAL_EXAMPLES, EVAL_REWARD_MEAN
from echo2.models.generate import HFEngine
from echo2.records import SamplingParams
from echo2.tasks.base import Task


def eval_due(step: int, every_steps: int, max_steps: int) -> bool:
    """Whether the policy of version ``step`` is evaluated: every ``every_steps`` versions (0: never) and the last
    one; version 0 (before training) is evaluated at the start of a run that is not resumed."""
    return bool(every_steps) and (step % every_steps == 0 or step == max_steps)


class Evaluator:
    def __init__(self, task: Task, tokenizer: Any, engine: HFEngine, batch_size: int = 64):
        from echo2.scoring import RewardFunctions

        self.task, self.tokenizer, self.engine, self.batch_size = task, tokenizer, engine, batch_size
        self.rows = list(task.eval_dataset())
        self.prompt_ids = [task.prompt_ids(tokenizer, r) for r in self.rows]
        self.params = SamplingParams(n=1, max_tokens=task.max_completion_length)
        self.judge = RewardFunctions(task)

    def __call__(self, policy: Any, version: int | None = None) -> dict[str, float]:
        """Greedy held-out accuracy of ``policy``; ``version``: the learner's step, what the reward functions that
        judge get as ``trainer_state.global_step`` (TRL hands its state when it evaluates)."""
        if version is not None:
            self.judge.set_step(version)
        episodes = self.task.episodes(self.tokenizer) if hasattr(self.task, "episodes") else None
        if episodes is not None:
            return self._episodes(episodes, policy)
        correct = 0
        for start in range(0, len(self.rows), self.batch_size):
            ids = self.prompt_ids[start : start + self.batch_size]
            outs = self.engine.generate(policy, ids, self.params, greedy=True)
            for row, (comp,) in zip(self.rows[start : start + self.batch_size], outs, strict=True):
                text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
                job = {"row": row, "texts": [text], "completion_ids": [comp.token_ids]}
                correct += self.judge.judge_job(job)["correct"][0]
        return {EVAL_ACCURACY: correct / max(1, len(self.rows)), EVAL_EXAMPLES: float(len(self.rows))}

    def _episodes(self, episodes: Any, policy: Any) -> dict[str, float]:
        """Greedy episodes of the held-out rows, scored from their transcripts."""
        scorer = self.judge
        greedy = lambda ids, params: self.engine.generate(policy, ids, params, greedy=True)  # noqa: E731
        context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        correct, values = 0, []
        for start in range(0, len(self.rows), self.batch_size):
            rows = self.rows[start : start + self.batch_size]
            for row, (t,) in zip(rows, episodes.run(greedy, rows, self.params, 1, context), strict=True):
                record = {**t.record(), "messages": episodes.transcript(t.prompt_ids, t.token_ids, t.mask,
                                                                         t.record(), row["prompt"], t.environment)}
                job = {"row": row, "texts": [self.tokenizer.decode(t.token_ids, skip_special_tokens=True)],
                       "completion_ids": [t.token_ids], "state": scorer.state, "episodes": [record]}
                judged = scorer.judge_job(job)
                correct += judged["correct"][0]
                values.append(judged["values"][0])
        scored = [v for v in values if v == v]
        return {EVAL_ACCURACY: correct / max(1, len(self.rows)), EVAL_EXAMPLES: float(len(self.rows)),
                EVAL_REWARD_MEAN: sum(scored) / len(scored) if scored else float("nan")}
