"""Rewards, computed on the learner's side (a worker never sends a reward the learner trusts).

Applies a task's TRL-style reward functions to a group, and sums them with the task's weights. A function
returning ``None`` for a completion abstains; if all abstain the reward is NaN (TRL's convention), which
the learner turns into a zero advantage.
"""

from __future__ import annotations

import math
from typing import Any

from echo2.rollout.types import RolloutGroup
from echo2.tasks.base import Task


class Scorer:
    def __init__(self, task: Task, tokenizer: Any):
        self.task, self.tokenizer = task, tokenizer
        self.funcs = task.reward_funcs()
        self.weights = task.reward_weights()
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"task {task.name}: {len(self.funcs)} reward funcs but {len(self.weights)} weights")

    def score(self, group: RolloutGroup) -> RolloutGroup:
        n = len(group.rollouts)
        for r in group.rollouts:
            r.text = self.tokenizer.decode(r.completion.token_ids, skip_special_tokens=True)
        columns = {k: [v] * n for k, v in group.row.items() if k != "prompt"}
        prompts = [group.row["prompt"]] * n
        completions = [r.text for r in group.rollouts]
        completion_ids = [r.completion.token_ids for r in group.rollouts]
        per_func = {}
        for f in self.funcs:
            out = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if len(out) != n:
                raise ValueError(f"reward {f.__name__} returned {len(out)} values for {n} completions")
            per_func[f.__name__] = [math.nan if v is None else float(v) for v in out]
        for i, r in enumerate(group.rollouts):
            r.rewards = {name: vals[i] for name, vals in per_func.items()}
            vals = [w * v for w, v in zip(self.weights, r.rewards.values()) if not math.isnan(v)]
            r.reward = sum(vals) if vals else math.nan
        return group


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
