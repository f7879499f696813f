"""The task adapter interface shared by every task.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float|None]``,
where ``columns`` are the dataset's other columns (lists aligned with ``completions``). So a function written
for TRL's ``GRPOTrainer(reward_funcs=...)`` drops in unchanged. ``None`` means "cannot score this one". As in
TRL, a completion is a string when the prompt is, and ``[{"role": "assistant", "content": text}]`` when the prompt
is a list of chat messages; ``completion_text`` reads either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datasets import Dataset

RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion as a reward function receives it: a string, or TRL's conversational form (a list
    holding one assistant message)."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


class Task:
    """A dataset of prompts with the columns its reward functions need, and how to score a completion.

    Subclasses set ``name`` and ``max_completion_length`` and implement the four methods below.
    """

    name: str = "task"
    max_completion_length: int = 16

    def train_dataset(self) -> Dataset:
        """Rows with a ``prompt`` (a string, or chat messages) and the columns the rewards read."""
        raise NotImplementedError

    def eval_dataset(self) -> Dataset:
        """Held-out rows in the same format, for ``eval/accuracy``."""
        raise NotImplementedError

    def reward_funcs(self) -> list[RewardFunc]:
        """TRL-style reward functions; the total reward is their weighted sum (``reward_weights``)."""
        raise NotImplementedError

    def reward_weights(self) -> list[float]:
        return [1.0] * len(self.reward_funcs())

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        """Whether a completion solves the row's problem (what ``eval/accuracy`` counts)."""
        raise NotImplementedError
