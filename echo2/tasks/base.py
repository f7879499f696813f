"""The task adapter interface shared by every task.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float|None]``,
where ``columns`` are the dataset's other columns (lists aligned with ``completions``), and it is handed what TRL
hands it besides (``trainer_state``, ``log_metric``, ``log_extra``; echo2/tasks/rewards.py), so a function written
for TRL's ``GRPOTrainer(reward_funcs=...)`` drops in unchanged. ``None`` means "cannot score this one". As in
TRL, a completion is a string when the prompt is, and ``[{"role": "assistant", "content": text}]`` when the prompt
is a list of chat messages; ``completion_text`` reads either.

A prompt becomes token ids through ``Task.prompt_ids`` everywhere (the learner's own generation and evaluation, the
coordinator's dispatch, the context a worker must hold), so that a task's ``chat_template_kwargs`` (Qwen3's
``enable_thinking=False``) apply alike on every path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datasets import Dataset

RewardFunc = Callable[..., list[float | None]]


def encode_prompt(tokenizer: Any, prompt: Any, **chat_template_kwargs: Any) -> list[int]:
    """Token ids of a prompt: chat messages go through the chat template (with ``chat_template_kwargs``, e.g.
    ``enable_thinking=False``, and ``tools=`` schemas), strings as TRL encodes a standard-format prompt
    (``processing_class(text=prompts)``: the tokenizer's own special tokens, a Llama tokenizer's BOS)."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **chat_template_kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


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
    chat_template_kwargs: dict[str, Any] = {}  # extra arguments of the chat template (never mutated: a default)

    def prompt_ids(self, tokenizer: Any, row: dict[str, Any]) -> list[int]:
        """The token ids a row's prompt is generated from (the chat template with ``chat_template_kwargs``)."""
        return encode_prompt(tokenizer, row["prompt"], **self.chat_template_kwargs)

    def episode_spec(self) -> Any:
        """A multi-turn task's EpisodeSpec (echo2/tasks/environments/); None: one completion per prompt."""
        return None

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

    def close(self) -> None:
        """The run is over in this process: let go of what the task holds here (a multi-turn task's pooled
        environments). Called by the learner's rollout source as it closes."""
