"""A multi-turn task trained with rollout=sync: the learner runs the episodes with its live policy (here a scripted
one that calls the environment's tool), trains on the model's tokens only (TRL's tool_mask), and logs turns, tool
calls, the environment's reward and how much of each completion was the environment's."""

from __future__ import annotations

from conftest import build_run, read_jsonl
from echo2.learner import trainer as _trainer  # noqa: F401 (imports DeepSpeed, which runs `uname`, at collection)
from own_envs import ScriptedPolicy


class ScriptedEngine:
    """The learner's engine interface (generate(policy, ids, params)) over a scripted policy."""

    def __init__(self, policy):
        self.policy = policy

    def generate(self, policy, prompt_ids, params, greedy=False):
        return self.policy.generate(prompt_ids, params)


def test_sync_episodes_train_on_the_models_tokens_only(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Count."}}], "target": {t}}}\n'
                            for t in (5, 5, 4, 4, 5, 4)))
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={rows}", "task.eval_size=0", "task.environment=own_envs:CounterEnv",
        "task.reward_funcs=[own_envs.reach_target]", "task.max_completion_length=300", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "run.steps=2"])
    source.engine = ScriptedEngine(ScriptedPolicy(trainer.processing_class, steps=(2, 3)))
    batches = []
    build = trainer._batch
    trainer._batch = lambda groups: batches.append(build(groups)) or batches[-1]
    trainer.train()
    step_log.sink.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["rollout/turns_mean"] for r in records] == [3.0, 3.0]
    assert [r["rollout/tool_calls_mean"] for r in records] == [2.0, 2.0]
    assert all(r["rollout/tool_errors"] == 0 and r["rollout/env_errors"] == 0 for r in records)
    assert all(0.3 < r["rollout/env_tokens_frac"] < 0.7 for r in records)
    for r in records:  # the steps add to 5: right for target 5, wrong for 4; the environment's reward agrees
        assert r["reward/reach_target"] == r["reward/CounterEnv"] == r["rollout/env_reward_mean"]
    batch = batches[0]
    tool_mask, completion_mask = batch["tool_mask"], batch["completion_mask"]
    assert (tool_mask == 0).any() and ((tool_mask == 0) <= (completion_mask == 1)).all()  # env tokens: attended
    assert batch["num_items_in_batch"] == (tool_mask * completion_mask).sum()  # only the model's are counted
    assert (batch["old_per_token_logps"][tool_mask == 0] == 0).all()
