"""Records that cross the rollout plane.

A ``Rollout`` is one completion: its token ids, the behaviour logprob of each token under the policy that
sampled it, and that policy's version (the number of optimizer steps behind its weights; docs/design.md §1). A
``RolloutGroup`` is the G completions of one prompt, admitted or dropped together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. Behaviour logprobs are of the distribution actually sampled from."""

    n: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    # Tokens that end a completion (besides the engine's own EOS): the run's stop tokens (models/tokenizer.py).
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    """What an engine returns for one sample. A multi-turn episode's completion (echo2/tasks/environments/) holds every
    token after the prompt, the environment's too: ``mask`` tells them apart (1: the model's, trained on; 0: the
    environment's, whose logprob is 0.0 and never trained on). None: every token is the model's."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (hit EOS) or "length" (hit max_tokens)
    mask: list[int] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but a mask of {len(self.mask)}")


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion: Completion
    version: int  # policy version that generated every token of the completion (every turn of an episode)
    text: str = ""
    reward: float = math.nan  # weighted sum of the task's rewards; NaN until scored or if unscorable
    rewards: dict[str, float] = field(default_factory=dict)
    # a multi-turn episode's record (echo2/tasks/environments/episode.py, Trajectory.record): the prompt it started
    # from, the environment's messages, counts, the environment's own reward and error; "messages" once read back
    episode: dict[str, Any] | None = None


@dataclass
class RolloutGroup:
    """The G rollouts of one prompt (``row`` is the dataset row: prompt plus reward columns). ``group_id`` and
    ``row_index`` (into the task's training set) name it in the consumed-rollout log; -1: not known."""

    row: dict[str, Any]
    rollouts: list[Rollout]
    group_id: str = ""
    row_index: int = -1
    worker_id: str = ""  # who generated it ("" for the learner's own sync source): for the rollout checks
    # what its reward functions logged (log_metric, log_extra) and the errors of those that failed, for the learner's
    # log: {"metrics": {name: [value]}, "extra": {column: [value per rollout]}, "errors": {function: reason}}
    reward_logs: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """The oldest version in the group: the group's staleness is judged by its stalest member."""
        return min(r.version for r in self.rollouts)
