"""A run with task=dataset and reward functions that use what TRL hands them: trainer_state follows the learner's
step, log_metric reaches the step's record (train/<name>, as TRL logs it), log_extra the completions log, an async
function is awaited, and a function that fails is counted per step (reward/errors/<name>) while the run goes on."""

from __future__ import annotations

from conftest import FIXTURES, build_run, read_jsonl
from echo2.learner import trainer as _trainer  # noqa: F401 (imports DeepSpeed, which runs `uname`, at collection)


def test_a_dataset_run_logs_what_its_reward_functions_logged(tmp_path):
    overrides = ["rollout=sync", "task=dataset", f"task.data_files={FIXTURES / 'datasets' / 'sums.jsonl'}",
                 "task.reward_funcs=[own_rewards.schedule,own_rewards.judge,own_rewards.broken]", "task.eval_size=2",
                 "task.max_completion_length=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "run.steps=2"]
    cfg, trainer, source, step_log = build_run(tmp_path, overrides)
    trainer.train()
    step_log.sink.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # trainer_state.global_step is the learner's version when the group was scored: 0 at step 1, 1 at step 2
    assert [r["reward/schedule"] for r in records] == [0.0, 1.0]
    assert [r["train/schedule_step"] for r in records] == [0.0, 1.0]
    assert [r["reward/errors/broken"] for r in records] == [2.0, 2.0]  # both groups of each step; the run went on
    assert all(r["reward/judge"] >= 0 for r in records)
    assert list(trainer._logs["extra"]["seen_step"]) == [1] * 4  # TRL keeps the last batch's completions
