"""Side by side with TRL: the same environment (CounterEnv, written for TRL's environment_factory) through TRL's own
GRPOTrainer and through echo2's learner with rollout=sync gives the same token layout, masks, rewards and advantages
for a batch, and the same reward at each of the first steps.

Both generate with one deterministic policy (tests/own_envs.SplitPolicy, which calls the environment's tool with
steps 2 then 3 in a group's first completion and 1 then 3 in its second: one reaches 5, the other 4, so every group's
advantages are not zero), patched in where each generates a turn (TRL's
``_generate_single_turn``, echo2's engine): so what differs is only how each builds the episode around the policy's
tokens, which is what is compared. The rows each step takes come from TRL's sampler in both (same seed)."""

from __future__ import annotations

import math

import torch

from conftest import ScriptedEngine, build_run, read_jsonl
from echo2.learner import trainer as _trainer  # noqa: F401 (imports DeepSpeed, which runs `uname`, at collection)
from echo2.records import SamplingParams
from own_envs import CounterEnv, SplitPolicy, SumEnv, reach_target

G, P, BUDGET, STEPS = 2, 2, 300, 3


def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Count."}}], "target": {t}}}\n'
                            for t in (5, 4, 4, 5, 5, 4, 5, 4)))
    return path


def echo2_run(tmp_path):
    cfg, trainer, source, step_log = build_run(tmp_path / "echo2", [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={rows_file(tmp_path)}", "task.eval_size=0", "task.environment=own_envs:CounterEnv",
        "task.reward_funcs=[own_envs.reach_target]", f"task.max_completion_length={BUDGET}",
        f"rollout.group_size={G}", f"rollout.prompts_per_step={P}", f"run.steps={STEPS}", "learner.learning_rate=1e-4"])
    source.engine = ScriptedEngine(SplitPolicy(trainer.processing_class))
    return cfg, trainer, source, step_log


def trl_trainer(tmp_path, model_path, tokenizer, dataset):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=P * G, num_generations=G,
                      max_completion_length=BUDGET, max_steps=STEPS, learning_rate=1e-4, logging_steps=1,
                      report_to="none", use_cpu=True, seed=0, loss_type="dapo", beta=0.0, save_strategy="no",
                      disable_tqdm=True, lr_scheduler_type="constant")
    trainer = GRPOTrainer(model=model_path, processing_class=tokenizer, reward_funcs=[reach_target], args=args,
                          train_dataset=dataset, environment_factory=CounterEnv)
    policy = SplitPolicy(tokenizer)

    def one_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turns = policy.generate(prompt_ids, SamplingParams(n=1, max_tokens=BUDGET))
        return [c.token_ids for (c,) in turns], [c.logprobs for (c,) in turns]

    trainer._generate_single_turn = one_turn
    return trainer


def test_the_same_batch_layout_masks_rewards_and_advantages_as_trl(tmp_path):
    cfg, echo2, source, _ = echo2_run(tmp_path)
    dataset = source.task.train_dataset()
    trl = trl_trainer(tmp_path, echo2.model.name_or_path, echo2.processing_class, dataset)
    inputs = [dataset[0]] * G + [dataset[1]] * G  # one batch: P rows, each G times (TRL's sampler's layout)
    echo2.model.train(), trl.model.train()
    theirs = trl._generate_and_score_completions([dict(r) for r in inputs])
    ours = echo2._generate_and_score_completions([dict(r) for r in inputs])
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages"):
        assert torch.equal(theirs[key].cpu(), ours[key].cpu()), key
    assert theirs["num_items_in_batch"] == ours["num_items_in_batch"]
    assert (ours["tool_mask"] == 0).sum() > 0  # environment tokens were there to compare
    groups = echo2.last_groups
    for name in ("reach_target", "CounterEnv"):  # TRL's get_reward column is named after the environment class
        assert list(trl._logs["rewards"][name]) == [r.rewards[name] for g in groups for r in g.rollouts], name
    assert [r.rewards["reach_target"] for g in groups for r in g.rollouts] == [1.0, 0.0, 0.0, 1.0]
    assert (ours["advantages"] != 0).all()  # a comparison of advantages that could differ


def test_the_same_reward_at_each_of_the_first_steps_as_trl(tmp_path):
    cfg, echo2, source, step_log = echo2_run(tmp_path)
    trl = trl_trainer(tmp_path, echo2.model.name_or_path, echo2.processing_class, source.task.train_dataset())
    echo2.train()
    step_log.sink.close()
    trl.train()
    ours = [r["reward/mean"] for r in read_jsonl(tmp_path / "echo2" / "metrics.jsonl")]
    theirs = [h["reward"] for h in trl.state.log_history if "reward" in h]
    assert len(ours) == len(theirs) == STEPS
    assert ours == theirs, (ours, theirs)
    assert len(set(ours)) > 1 or ours[0] not in (0.0, 2.0)  # the steps drew different rows: a real comparison


ENVS = {"count": CounterEnv, "sum": SumEnv}


def test_several_environments_give_the_same_batch_as_trls_dict_environment_factory(tmp_path):
    """TRL's GRPOTrainer(environment_factory={name: factory}) and echo2's task.environment={name: path} on the same
    rows, two of each environment, through one scripted policy that calls the tool its prompt shows (a group's two
    completions reach different totals): the same prompts (each showing its own environment's tools), completions, masks, per-class
    reward columns (NaN on the other environment's rows in both) and advantages."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Go."}}], "target": {t}, '
                            f'"environment": "{e}"}}\n' for e, t in (("count", 5), ("sum", 9), ("count", 4),
                                                                      ("sum", 8))))
    envs = "{" + ", ".join(f"{n}: own_envs:{c.__name__}" for n, c in ENVS.items()) + "}"
    cfg, echo2, source, _ = build_run(tmp_path / "echo2", [
        "rollout=sync", "model.path.tool_chat=true", "model.path.max_position_embeddings=2048", "task=dataset",
        f"task.data_files={path}", "task.eval_size=0", f"task.environment={envs}",
        f"task.max_completion_length={BUDGET}", "rollout.group_size=2", "rollout.prompts_per_step=4", "run.steps=1"])
    source.engine = ScriptedEngine(SplitPolicy(echo2.processing_class))
    dataset = source.task.train_dataset()
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=2,
                      max_completion_length=BUDGET, max_steps=1, learning_rate=1e-4, report_to="none", use_cpu=True,
                      seed=0, loss_type="dapo", beta=0.0, save_strategy="no", disable_tqdm=True)
    trl = GRPOTrainer(model=echo2.model.name_or_path, processing_class=echo2.processing_class, args=args,
                      train_dataset=dataset, environment_factory=ENVS)
    policy = SplitPolicy(echo2.processing_class)

    def one_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turns = policy.generate(prompt_ids, SamplingParams(n=1, max_tokens=BUDGET))
        return [c.token_ids for (c,) in turns], [c.logprobs for (c,) in turns]

    trl._generate_single_turn = one_turn
    inputs = [dataset[i] for i in range(4) for _ in range(2)]
    echo2.model.train(), trl.model.train()
    theirs = trl._generate_and_score_completions([dict(r) for r in inputs])
    ours = echo2._generate_and_score_completions([dict(r) for r in inputs])
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages"):
        assert torch.equal(theirs[key].cpu(), ours[key].cpu()), key
    text = [echo2.processing_class.decode(ids) for ids in ours["prompt_ids"][::2]]
    assert ['"name": "add"' in t for t in text] == [False, True, False, True]  # each row shows its own tools
    rollouts = [r for g in echo2.last_groups for r in g.rollouts]
    for name in ("CounterEnv", "SumEnv"):
        t, o = list(trl._logs["rewards"][name]), [r.rewards[name] for r in rollouts]
        assert [math.isnan(x) for x in t] == [math.isnan(x) for x in o], name
        assert [x for x in t if not math.isnan(x)] == [x for x in o if not math.isnan(x)], name
    assert [r.reward for r in rollouts] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert (ours["advantages"] != 0).all()  # a comparison of advantages that could differ
