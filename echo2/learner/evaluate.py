"""Greedy accuracy on the task's held-out split: ``eval/accuracy``.

Run by the learner every ``run.eval_every_steps`` steps with its live policy, on every rank (under ZeRO-3 the
gathered weights are needed everywhere); rank 0 logs it. A multi-turn task's held-out rows are whole episodes
(greedy turns, its environment answering), scored by its reward functions from their transcripts: correct when the
task's eval column reaches its threshold (task=dataset: ``eval_reward``, ``eval_threshold``).
"""

from __future__ import annotations

import inspect
from typing import Any

from echo2.metrics import EVAL_ACCURACY, EVAL_EXAMPLES, EVAL_REWARD_MEAN
from echo2.models.generate import HFEngine
from echo2.records import SamplingParams
from echo2.tasks.base import Task


class Evaluator:
    def __init__(self, task: Task, tokenizer: Any, engine: HFEngine, batch_size: int = 64):
        self.task, self.tokenizer, self.engine, self.batch_size = task, tokenizer, engine, batch_size
        self.rows = list(task.eval_dataset())
        self.prompt_ids = [task.prompt_ids(tokenizer, r) for r in self.rows]
        # a task that scores with token ids too (a reward function of them, as task=dataset's may be) is handed them
        self.with_ids = "completion_ids" in inspect.signature(task.is_correct).parameters
        self.params = SamplingParams(n=1, max_tokens=task.max_completion_length)

    def __call__(self, policy: Any) -> dict[str, float]:
        episodes = self.task.episodes(self.tokenizer) if hasattr(self.task, "episodes") else None
        if episodes is not None:
            return self._episodes(episodes, policy)
        correct = 0
        for start in range(0, len(self.rows), self.batch_size):
            ids = self.prompt_ids[start : start + self.batch_size]
            outs = self.engine.generate(policy, ids, self.params, greedy=True)
            for row, (comp,) in zip(self.rows[start : start + self.batch_size], outs, strict=True):
                text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
                ids = {"completion_ids": comp.token_ids} if self.with_ids else {}
                correct += bool(self.task.is_correct(text, row, **ids))
        return {EVAL_ACCURACY: correct / max(1, len(self.rows)), EVAL_EXAMPLES: float(len(self.rows))}

    def _episodes(self, episodes: Any, policy: Any) -> dict[str, float]:
        """Greedy episodes of the held-out rows, scored from their transcripts."""
        from echo2.scoring import RewardFunctions, RewardsFailed

        name, threshold = self.task.correct_when()
        scorer = RewardFunctions(self.task)
        greedy = lambda ids, params: self.engine.generate(policy, ids, params, greedy=True)  # noqa: E731
        context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        correct, values = 0, []
        for start in range(0, len(self.rows), self.batch_size):
            rows = self.rows[start : start + self.batch_size]
            for row, (t,) in zip(rows, episodes.run(greedy, rows, self.params, 1, context), strict=True):
                record = {**t.record(), "messages": episodes.transcript(t.prompt_ids, t.token_ids, t.mask,
                                                                         t.record(), row["prompt"])}
                job = {"row": row, "texts": [self.tokenizer.decode(t.token_ids, skip_special_tokens=True)],
                       "completion_ids": [t.token_ids], "state": scorer.state, "episodes": [record]}
                try:
                    value = scorer.compute_job(job)["rewards"][name][0]
                except RewardsFailed:
                    value = float("nan")
                correct += bool(value >= threshold)
                values.append(value)
        scored = [v for v in values if v == v]
        return {EVAL_ACCURACY: correct / max(1, len(self.rows)), EVAL_EXAMPLES: float(len(self.rows)),
                EVAL_REWARD_MEAN: sum(scored) / len(scored) if scored else float("nan")}
