"""TRL's reward-function contract through the coordinator's reward processes: the trainer state the coordinator
sets (the learner's version), async functions, and what log_metric / log_extra logged coming back with the group."""

from __future__ import annotations

import math

import pytest

from conftest import FIXTURES
from echo2.records import Completion, Rollout, RolloutGroup
from echo2.tasks.dataset import DatasetTask

pytestmark = pytest.mark.e2e  # reward processes


def test_the_pool_hands_trl_extras_and_brings_the_logs_back():
    from echo2.coordinator.reward_pool import RewardPool

    task = DatasetTask(data_files=str(FIXTURES / "datasets" / "sums.jsonl"), eval_size=2,
                       reward_funcs=["own_rewards.schedule", "own_rewards.judge", "own_rewards.broken"])
    pool = RewardPool(task, tokenizer=None, processes=1, timeout_s=30, max_steps=9)
    try:
        pool.set_step(5)
        rollouts = [Rollout([1], Completion([5], [-1.0], "stop"), 0, text=t) for t in ("12", "7")]
        group = RolloutGroup(row={"prompt": "1+1=", "answer": "2", "difficulty": 1}, rollouts=rollouts, group_id="g")
        assert pool.score_many([group]) == [None]
        assert [r.rewards["schedule"] for r in rollouts] == [5.0, 5.0]
        assert [r.rewards["judge"] for r in rollouts] == [2.0, 1.0]
        assert all(math.isnan(r.rewards["broken"]) for r in rollouts)
        assert group.reward_logs["metrics"] == {"schedule_step": [5.0]}
        assert group.reward_logs["extra"] == {"seen_step": [5, 5]}
        assert group.reward_logs["errors"]["broken"].startswith("ZeroDivisionError")
    finally:
        pool.close()
