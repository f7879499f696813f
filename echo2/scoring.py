"""Rewards, computed on the learner's side (a worker never sends a reward the learner trusts).

Applies a task's TRL-style reward functions to a group, and sums them with the task's weights. A function
returning ``None`` for a completion abstains; if all abstain the reward is NaN (TRL's convention), which
the learner turns into a zero advantage. The coordinator process runs the functions in a pool of processes of
their own, with a time limit per group (echo2/coordinator/reward_pool.py); the learner's own sources call
``Scorer`` in place.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from echo2.records import RolloutGroup
from echo2.tasks.base import Task

log = logging.getLogger(__name__)


class RewardFunctions:
    """A task's reward functions and weights, without a tokenizer: what a reward process
    (echo2/coordinator/reward_pool.py) holds."""

    def __init__(self, task: Task):
        self.funcs = task.reward_funcs()
        # learner.trl.reward_weights (TRL's name), set on the task by train.py, else the task's own
        self.weights = list(getattr(task, "reward_weights_override", None) or task.reward_weights())
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"task {task.name}: {len(self.funcs)} reward funcs but {len(self.weights)} weights")

    def compute(self, row: dict[str, Any], completions: list[str], completion_ids: list[list[int]]) -> dict:
        """Each function's value for each completion, ``{name: [value or NaN]}`` (None, an abstention, is NaN)."""
        n = len(completions)
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        prompts = [row["prompt"]] * n
        if not isinstance(row["prompt"], str):  # chat messages: TRL hands rewards conversational completions
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        per_func = {}
        for f in self.funcs:
            out = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if len(out) != n:
                raise ValueError(f"reward {f.__name__} returned {len(out)} values for {n} completions")
            per_func[f.__name__] = [math.nan if v is None else float(v) for v in out]
        return per_func

    def apply(self, group: RolloutGroup, per_func: dict) -> RolloutGroup:
        """Set each rollout's rewards and their weighted sum (NaN if every function abstained)."""
        for i, r in enumerate(group.rollouts):
            r.rewards = {name: vals[i] for name, vals in per_func.items()}
            vals = [w * v for w, v in zip(self.weights, r.rewards.values()) if not math.isnan(v)]
            r.reward = sum(vals) if vals else math.nan
        return group


class Scorer(RewardFunctions):
    """Scores in the calling thread (the learner's own sources, and coordinators in tests); the coordinator
    process scores in a RewardPool instead, which has the same ``score_many``."""

    def __init__(self, task: Task, tokenizer: Any):
        super().__init__(task)
        self.task, self.tokenizer = task, tokenizer

    def score(self, group: RolloutGroup) -> RolloutGroup:
        decode(self.tokenizer, group)
        return self.apply(group, self.compute(group.row, [r.text for r in group.rollouts],
                                              [r.completion.token_ids for r in group.rollouts]))

    def score_many(self, groups: list[RolloutGroup]) -> list[str | None]:
        """Score each group in place; per group None, or why it could not be (``reward_error``: a reward raised)."""
        reasons: list[str | None] = []
        for group in groups:
            try:
                self.score(group)
                reasons.append(None)
            except Exception as e:
                log.warning("reward failed on group %s: %s: %s", group.group_id, type(e).__name__, e)
                reasons.append("reward_error")
        return reasons

    def metrics(self) -> dict[str, float]:
        return {}  # scores in the caller's thread: nothing to count beyond the coordinator's own books

    def close(self) -> None:
        pass


def decode(tokenizer: Any, group: RolloutGroup) -> None:
    """Each rollout's text, as the reward functions read it."""
    for r in group.rollouts:
        r.text = tokenizer.decode(r.completion.token_ids, skip_special_tokens=True)


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: chat messages go through the chat template, strings are encoded as is."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def longest_prompt(tokenizer: Any, prompts: list[Any]) -> int:
    """Tokens in the longest of ``prompts`` (as encode_prompt counts them): what a worker's context must hold
    before the completion. Plain strings are tokenized in one batch."""
    text = [p for p in prompts if isinstance(p, str)]
    longest = max(map(len, tokenizer(text, add_special_tokens=False)["input_ids"]), default=0) if text else 0
    return max([longest, *(len(encode_prompt(tokenizer, p)) for p in prompts if not isinstance(p, str))])
