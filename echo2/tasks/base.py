"""The task adapter interface shared by every task.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float|None]``,
where ``columns`` are the dataset's other columns (lists aligned with ``completions``). So a function written
for TRL's ``GRPOTrainer(reward_funcs=...)`` drops in unchanged. ``None`` means "cannot score this one".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datasets import Dataset

RewardFunc = Callable[..., list[float | None]]


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
