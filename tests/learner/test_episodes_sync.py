"""A multi-turn task trained with rollout=sync: the learner runs the episodes with its live policy (here a scripted
one that calls the environment's tool), trains on the model's tokens only (TRL's tool_mask), and logs turns, tool
calls, the environment's reward and how much of each completion was the environment's."""

from __future__ import annotations

from conftest import ScriptedEngine, build_run, read_jsonl
from echo2.learner import trainer as _trainer  # noqa: F401 (imports DeepSpeed, which runs `uname`, at collection)
from own_envs import ScriptedPolicy


def test_sync_episodes_train_on_the_models_tokens_only(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Count."}}], "target": {t}}}\n'
                            for t in (5, 5, 4, 4, 5, 4)))
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={rows}", "task.eval_size=0", "task.environment=own_envs:CounterEnv",
        "task.reward_funcs=[own_envs.reach_target]", "task.max_completion_length=300", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "run.steps=2", "learner.micro_batch_size=2"])  # tool_mask split too
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


def test_an_environment_that_owns_its_data_trains_without_a_dataset(tmp_path):
    """TRL's GRPOTrainer takes no train_dataset when the environment makes each prompt in reset(): rows of an empty
    user message, the environment's text appended. Before, task=dataset refused to start without task.path or
    task.data_files."""
    import own_envs

    own_envs.DrawEnv.draws.seed(0)  # its draws, whatever ran before
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        "task.eval_size=4", "task.environment=own_envs:DrawEnv", "task.max_completion_length=300",
        "rollout.group_size=2", "rollout.prompts_per_step=2", "run.steps=2", "learner.micro_batch_size=2"])
    task = source.task
    assert task.name == "environment:DrawEnv" and len(task.eval_dataset()) == 4
    assert task.train_dataset()[0]["prompt"] == [{"role": "user", "content": ""}]
    source.engine = ScriptedEngine(ScriptedPolicy(trainer.processing_class, steps=(2, 3)))
    trainer.train()
    step_log.sink.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["rollout/turns_mean"] for r in records] == [3.0, 3.0] and all("reward/DrawEnv" in r for r in records)
    assert {r["reward/DrawEnv"] for r in records} != {1.0}  # the targets it drew (4 or 5) decide, not the rows


def test_a_dataset_is_still_needed_without_an_environment_that_owns_the_data():
    import pytest

    from echo2.tasks.dataset import DatasetTask

    with pytest.raises(ValueError, match="only a TRL environment"):
        DatasetTask(reward_funcs=["trl.rewards.accuracy_reward"])
    with pytest.raises(ValueError, match="only a TRL environment"):
        DatasetTask(environment="own_envs:StepsEnv")  # SkyRL's init(prompt) needs the row's prompt
    with pytest.raises(ValueError, match="task.eval_split / task.prompt_column"):
        DatasetTask(environment="own_envs:DrawEnv", eval_split="test")


def test_a_skyrl_environments_own_metrics_reach_the_learners_log(tmp_path):
    """What SkyRL's get_metrics() returns after each episode is averaged per step, as SkyRL averages it, into
    rollout/environment/<name>; what is not a number is left out."""
    from echo2.records import Completion

    class Say:  # answers "7" every turn
        def generate(self, prompt_ids, params):
            ids = tok("7<|im_end|>", add_special_tokens=False)["input_ids"]
            return [[Completion(list(ids), [-0.5] * len(ids), "stop")] * params.n for _ in prompt_ids]

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Say {t}."}}], '
                            f'"reward_spec": {{"ground_truth": "{t}"}}}}\n' for t in (7, 7, 3, 3, 7, 3)))
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={rows}", "task.eval_size=0", "task.environment=own_envs:VerdictEnv", "task.max_turns=3",
        "task.reward_funcs=[]", "task.max_completion_length=300", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "run.steps=2", "learner.micro_batch_size=2"])
    tok = trainer.processing_class
    source.engine = ScriptedEngine(Say())
    trainer.train()
    step_log.sink.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["rollout/environment/steps"] for r in records] == [3.0, 3.0]
    assert [r["rollout/environment/solved"] for r in records] == [1.0, 1.0]
    assert not any(k.startswith("rollout/environment/") and k.rsplit("/", 1)[1] in ("note", "big")
                   for r in records for k in r)


def test_held_out_episodes_are_played_greedily_and_scored_from_their_transcripts(tmp_path, echo2_cache):
    from echo2.learner.evaluate import Evaluator
    from echo2.models.tiny import build_tiny
    from echo2.models.tokenizer import load_tokenizer
    from echo2.tasks.dataset import DatasetTask

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Count."}}], "target": {t}}}\n'
                            for t in (5, 4, 5, 5, 4, 5, 4, 4)))
    tok = load_tokenizer(build_tiny(tool_chat=True, max_position_embeddings=2048))
    task = DatasetTask(data_files=str(rows), eval_size=4, seed=1, environment="own_envs:CounterEnv",
                       reward_funcs=["own_envs.reach_target"], max_completion_length=300)
    out = Evaluator(task, tok, ScriptedEngine(ScriptedPolicy(tok, steps=(2, 3))))(policy=None)
    held_out = list(task.eval_dataset()["target"])
    assert out["eval/examples"] == 4 and out["eval/accuracy"] == held_out.count(5) / 4
    assert out["eval/reward_mean"] == held_out.count(5) / 4


def test_rollout_checks_score_the_models_tokens_only(tmp_path):
    """A worker's behaviour logprobs are compared with the learner's on the model's tokens: the environment's (logprob
    0.0 by contract) are neither counted nor scored, or every honest multi-turn worker would look like a forger."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Count."}], "target": 5}\n' * 4)
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={rows}", "task.eval_size=0", "task.environment=own_envs:CounterEnv",
        "task.reward_funcs=[own_envs.reach_target]", "task.max_completion_length=300", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "run.steps=1"])
    source.engine = ScriptedEngine(ScriptedPolicy(trainer.processing_class, steps=(2, 3)))
    trainer.model.train()
    groups = source.collect([dict(r) for r in source.task.train_dataset()][:2], version=0, policy=trainer.model)
    for g in groups:
        g.worker_id = "w1"
    stats = {}
    source.on_check = lambda s: stats.update(s) or []
    source.check_every_steps = 1
    trainer.rollout_source = source
    trainer._collect = lambda rows: groups
    batch = trainer._generate_and_score_completions([{}] * 4)
    tokens, _, absolute = stats["w1"]
    assert tokens == int((batch["tool_mask"] * batch["completion_mask"]).sum()) < int(batch["completion_mask"].sum())
    assert absolute / tokens < 10  # the model's own tokens: the learner's logprobs against the scripted -0.5


def test_the_calculator_task_trains_offline_on_the_tiny_tool_calling_model(tmp_path):
    """task=calculator end to end in the learner, with the tiny model's Qwen3 template and its own (random) policy:
    the prompt carries the tool's schema, the episodes run, the step trains and evaluates."""
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "task=calculator", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048",
        "task.train_size=8", "task.eval_size=2", "task.max_completion_length=24", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "run.steps=1", "run.eval_every_steps=1"])
    trainer.train()
    step_log.sink.close()
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["rollout/turns_mean"] >= 1 and record["rollout/env_errors"] == 0
    assert {"reward/correct", "reward/used_calculator", "eval/accuracy", "eval/reward_mean"} <= set(record)


def test_the_environments_own_metrics_are_logged_for_the_names_most_episodes_report():
    """A worker's episodes may each name 32 metrics of their own: a step logs at most ENV_METRIC_NAMES of them, those
    the most episodes reported, so that no one worker opens a thousand series in the run's log."""
    from collections import defaultdict
    from types import SimpleNamespace

    from echo2.learner.reward_logs import ENV_METRIC_NAMES, log_episodes
    from echo2.records import Completion, Rollout, RolloutGroup

    def rollout(metrics):
        return Rollout(prompt_ids=[1], completion=Completion([2], [-0.1], "stop", mask=[1]), version=0,
                       episode={"turns": 1, "metrics": metrics})

    honest = [rollout({"steps": 3.0, "solved": 1.0}) for _ in range(4)]
    noisy = [rollout({f"junk{i}_{j}": 1.0 for j in range(32)}) for i in range(3)]
    trainer = SimpleNamespace(accelerator=SimpleNamespace(gather=lambda t: t, device="cpu"),
                              _metrics={"train": defaultdict(list)})
    log_episodes(trainer, [RolloutGroup(row={}, rollouts=honest + noisy)])
    logged = [k for k in trainer._metrics["train"] if k.startswith("rollout/environment/")]
    assert len(logged) == ENV_METRIC_NAMES
    assert trainer._metrics["train"]["rollout/environment/steps"] == [3.0]
    assert trainer._metrics["train"]["rollout/environment/solved"] == [1.0]
