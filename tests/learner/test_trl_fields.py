"""The learner.trl pass-through is honest: every GRPOConfig field is classified, refused ones fail when the config is
checked (naming the echo2 key or the reason), TRL's names point to echo2's, and the fields echo2 reads itself
(reward_weights, generation_kwargs) reach the scorers and engines."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
from trl import GRPOConfig, GRPOTrainer  # noqa: F401 (here, at collection: its first import probes the platform)

from conftest import build_run, compose
from echo2.config import ConfigError, unknown_key, validate
from echo2.learner import trl_fields
from echo2.learner.args import grpo_kwargs


def test_every_grpo_config_field_is_classified():
    """Fails when a TRL upgrade adds a GRPOConfig field nobody classified (or drops one): decide whether echo2 owns,
    refuses, reads or passes it, in echo2/learner/trl_fields.py."""
    assert trl_fields.unclassified() == []
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    classes = {n: trl_fields.classify(n)[0] for n in names}
    assert set(classes.values()) == {"owned", "refused", "echo2", "passed"}


def test_the_classification_check_can_fail(monkeypatch):
    fields = dict(trl_fields.grpo_fields())
    fields["shiny_new_knob"] = None
    monkeypatch.setattr(trl_fields, "grpo_fields", lambda: fields)
    assert trl_fields.unclassified() == ["shiny_new_knob"]


def test_what_echo2_sets_is_what_it_refuses_as_owned():
    """Every GRPOConfig field grpo_config sets is OWNED (so passing it names the echo2 key instead of TypeError:
    multiple values), and every echo2 key OWNED names is a real option."""
    set_by_echo2 = set(grpo_kwargs(compose([]), "/tmp/run", 1))
    assert set_by_echo2 - set(trl_fields.OWNED) == set()
    for field, where in trl_fields.OWNED.items():
        key = where.split(" ")[0]
        if re.fullmatch(r"(learner|rollout|run|task)\.\w+", key):
            assert unknown_key(key) is None, (field, key)


@pytest.mark.parametrize("override, says", [
    ("+learner.trl.num_generations=4", "use rollout.group_size"),
    ("+learner.trl.per_device_train_batch_size=4", "use learner.micro_batch_size"),
    ("+learner.trl.report_to=tensorboard", "use run.report_to"),
    ("+learner.trl.max_steps=10", "use run.steps"),
    ("+learner.trl.vllm_mode=server", "echo2's workers run vLLM themselves"),
    ("+learner.trl.min_p=0.1", "reshapes the sampling distribution"),
    ("+learner.trl.multi_objective_aggregation=normalize_then_sum", "normalize_then_sum is not implemented"),
    ("+learner.trl.use_peft=true", "not a field of TRL's GRPOConfig"),
    ("+learner.trl.top_entropy=0.2", "did you mean learner.trl.top_entropy_quantile?"),
    ("+learner.trl.importance_sampling_level=seq", "TRL takes sequence, token"),
    ("+learner.trl.reward_weights=oops", "a list of numbers"),
    ("+learner.trl.generation_kwargs={top_p:0.9}", "echo2 sets it from rollout.top_p"),
    ("+learner.trl.generation_kwargs={repetition_penalty:1.1}", "reshapes the sampling distribution"),
    ("+learner.trl.model_init_kwargs={dtype:bfloat16}", "model.dtype"),
    ("learner.loss_type=gspo", "computes bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo"),
    ("learner.num_iterations=0", "learner.num_iterations=0: must be >= 1"),
    ("learner.num_iterations=4", "save every multiple of 4 steps"),
])
def test_refused_when_the_config_is_checked(override, says):
    """Each refusal comes from validate(), which train.py runs before the model loads or any process starts."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(compose([override]))


def test_loss_types_are_read_from_trl():
    """The loss types echo2 accepts are what TRL's _compute_loss handles (read from its source), which is also
    what GRPOConfig's own documentation lists: two independent readings of the installed TRL."""
    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    documented = set(re.findall(r"'(\w+)'", help_text.split("Supported values are", 1)[1].split(". ")[0]))
    assert set(trl_fields.loss_types()) == documented and "dapo" in documented
    assert trl_fields.importance_sampling_levels() == ("sequence", "token")


@pytest.mark.parametrize("override", ["+learner.trl.importance_sampling_level=sequence", "+learner.trl.optim=sgd",
                                      "+learner.trl.top_entropy_quantile=0.2", "+learner.trl.reward_weights=[2.0]",
                                      "+learner.trl.generation_kwargs={stop_token_ids:[3]}",
                                      "+learner.trl.model_init_kwargs={attn_implementation:eager}",
                                      "learner.num_iterations=2"])
def test_fields_trls_training_path_reads_pass(override):
    validate(compose([override]))


@pytest.mark.parametrize("key, says", [
    ("learner.num_generations", "TRL's num_generations is rollout.group_size in echo2"),
    ("num_generations", "TRL's num_generations is rollout.group_size in echo2"),
    ("learner.max_steps", "TRL's max_steps is run.steps in echo2"),
    ("run.save_steps", "TRL's save_steps is run.save_every_steps in echo2"),
    ("learner.report_to", "TRL's report_to is run.report_to in echo2"),
    ("learner.per_device_train_batch_size", "TRL's per_device_train_batch_size is learner.micro_batch_size"),
    ("learner.importance_sampling_level", "TRL's importance_sampling_level is set as "
                                          "learner.trl.importance_sampling_level"),
    ("learner.use_vllm", "TRL's use_vllm is not used by echo2"),
])
def test_trl_names_point_to_echo2s(key, says):
    assert says in unknown_key(key)


def test_reward_weights_weight_every_scorer(tmp_path):
    """learner.trl.reward_weights scales the task's reward functions wherever rollouts are scored: the learner's
    own scorer (the sync source) and, through the pickled task, the coordinator's reward processes."""
    from echo2.scoring import RewardFunctions

    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=1", "+learner.trl.reward_weights=[2.5]",
                                                   "rollout.prompts_per_step=4"])
    trainer.train()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert all(r.reward == 2.5 * r.rewards["correct"] for r in rollouts)
    assert RewardFunctions(pickle.loads(pickle.dumps(source.scorer.task))).weights == [2.5]


def test_reward_weights_of_the_wrong_length_fail_before_the_model_loads(tmp_path, monkeypatch):
    from echo2.models import tokenizer

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the reward weights were checked")

    monkeypatch.setattr(tokenizer, "load_tokenizer", loaded)
    with pytest.raises(ConfigError, match=r"has 1 reward function\(s\) \(correct\), so give 1 weight"):
        build_run(tmp_path, ["rollout=sync", "+learner.trl.reward_weights=[1.0,2.0]"])


def test_generation_stop_tokens_reach_the_engine(tmp_path, tiny_model_dir):
    """learner.trl.generation_kwargs.stop_token_ids: completions end at those tokens too (the tiny model's digits
    here, so nearly every completion stops at its first digit)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    cfg, trainer, source, _ = build_run(tmp_path, [
        "rollout=sync", "run.steps=1", "rollout.prompts_per_step=4", "task.max_completion_length=6",
        f"+learner.trl.generation_kwargs={{stop_token_ids:[{','.join(map(str, digits))}]}}"])
    assert set(digits) <= set(source.sampling.stop_token_ids)
    trainer.train()
    completions = [r.completion for g in trainer.last_groups for r in g.rollouts]
    stopped_on_digit = [c for c in completions if c.finish_reason == "stop" and c.token_ids[-1] in digits]
    assert stopped_on_digit, "no completion ended at an added stop token"
    assert all(not set(c.token_ids[:-1]) & set(digits) for c in completions), "a completion ran past a stop token"


def test_the_field_table_in_the_docs_is_the_installed_trls():
    from conftest import ROOT

    doc = (ROOT / "docs" / "trl.md").read_text()
    assert doc.split("## GRPOConfig, field by field\n", 1)[1].endswith(trl_fields.markdown()), \
        "docs/trl.md is stale: regenerate its last section with python -m echo2.learner.trl_fields"


def test_model_init_kwargs_are_merged_with_echo2s_dtype(tmp_path):
    """learner.trl.model_init_kwargs reaches TRL's from_pretrained beside echo2's dtype (float32 for the tiny model)."""
    cfg, trainer, _, _ = build_run(tmp_path, ["rollout=sync", "+learner.trl.model_init_kwargs={attn_implementation:eager}"])
    assert trainer.args.model_init_kwargs == {"attn_implementation": "eager", "dtype": "float32"}
    assert trainer.model.config._attn_implementation == "eager"
