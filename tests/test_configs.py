"""Every option of every group composes and passes validation; the tiny model, the arith and gsm8k tasks and the
hub models' ids instantiate; typos, wrong types and impossible settings fail early, naming the key."""

from __future__ import annotations

import re

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import CONF, FIXTURES, compose
from echo2.config import validate


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "task", "learner", "rollout", "broadcast", "pool", "experiment"])
def test_every_option_composes(group):
    names = options(group)
    assert names, f"conf/{group} is empty"
    for name in names:
        cfg = compose([f"{group}={name}"])
        validate(cfg, world_size=1)
        if group == "learner" and name != "default":  # multi-process learners run the sync source for now
            validate(compose([f"{group}={name}", "rollout=sync"]), world_size=2)


def test_tiny_model_and_arith_instantiate(tiny_model_dir):
    cfg = compose()
    assert instantiate(cfg.model.path) == tiny_model_dir
    task = instantiate(cfg.task)
    assert len(task.train_dataset()) == cfg.task.train_size


def test_gsm8k_instantiates_on_local_fixture():
    cfg = compose(["task=gsm8k", f"task.data_dir={FIXTURES / 'gsm8k'}"])
    task = instantiate(cfg.task)
    assert task.train_dataset()[0]["answer"] == "29"


def test_hub_models_name_the_hub_id(tiny_model_dir):
    """A hub id resolves to its local snapshot; offline without one (as here), to one error naming it."""
    from echo2.models.hub import from_hub

    for name in [n for n in options("model") if n.startswith("qwen3")]:
        cfg = compose([f"model={name}"])
        assert cfg.model.path.name_or_path.startswith("Qwen/Qwen3-")
        with pytest.raises(Exception, match=rf"model '{cfg.model.path.name_or_path}' is not in the local"):
            instantiate(cfg.model.path)
    assert from_hub(tiny_model_dir) == tiny_model_dir


@pytest.mark.parametrize("override", ["rollout.stalenes=4", "learner.lr=1e-3", "task.levle=copy", "run.step=3"])
def test_typo_fails_at_compose_time(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose([override])


def test_wrong_type_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose(["rollout.group_size=eight"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.group_size=1"], "rollout.group_size"),
        (["rollout=sync", "rollout.staleness=2"], re.escape("SyncRolloutSource supports S <= 0")),
        (["rollout.staleness=1", "broadcast.interval=3"], re.escape("interval <= S+1")),
        (["rollout.correction=magic"], "rollout.correction"),
        (["rollout.correction=icepop", "rollout.icepop_min=2"], "rollout.icepop_min=2.0"),
        (["rollout.seq_max=0.9"], "rollout.seq_min=0.5, seq_max=0.9"),
        (["rollout.correction=m2po", "rollout.m2_threshold=0"], "rollout.m2_threshold"),
        (["run.wandb=maybe"], "run.wandb"),
        (["rollout=sync", "rollout.prompts_per_step=3"], "multiple of the 2 learner processes"),
        (["rollout.source.check_every_steps=5"], "check_every_steps > 0 with a multi-process learner"),
    ],
)
def test_validation_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose(overrides), world_size=2)


def test_deepspeed_settings_are_overridable():
    cfg = compose(["learner=zero2", "learner.deepspeed.zero_optimization.overlap_comm=true"])
    assert cfg.learner.deepspeed.zero_optimization.stage == 2
    assert cfg.learner.deepspeed.zero_optimization.overlap_comm is True
    assert compose(["learner=zero3"]).learner.deepspeed.zero_optimization.stage == 3


@pytest.mark.parametrize("override, why", [
    ("rollout.stalenes=4", "did you mean rollout.staleness"), ("+rollout.stalenes=4", "did you mean rollout.staleness"),
    ("++run.stepz=3", "did you mean run.steps"), ("task.levl=mod10", "did you mean task.level"),
    ("sede=1", "did you mean seed"), ("rollout.stalenes=0,2,4", "no such option in rollout"),
])
def test_an_override_that_names_no_option_is_refused_before_composing(override, why):
    from echo2.config import check_overrides

    errors = check_overrides([override])
    assert len(errors) == 1 and why in errors[0] and "+" not in errors[0], errors


@pytest.mark.parametrize("override", [
    "rollout.staleness=4", "rollout=sync", "hydra/launcher=slurm", "experiment=mod10", "+learner.trl.top_entropy=1",
    "rollout.source.min_workers=2", "pool.workers=3", "learner.deepspeed.zero_optimization.overlap_comm=true",
    "model.path.name_or_path=/x", "hydra.run.dir=/tmp/x", "~run.group",
])
def test_real_options_and_free_form_nodes_pass_the_override_check(override):
    from echo2.config import check_overrides

    assert check_overrides([override]) == []


def test_a_key_added_with_plus_fails_validation_after_composing():
    """Hydra's ``+`` adds keys to structured configs unchecked; validate() catches what reaches it that way."""
    cfg = compose(["+rollout.stalenes=4"])
    with pytest.raises(ValueError, match=r"rollout.stalenes: no such option in rollout \(did you mean"):
        validate(cfg)
    validate(compose(["+learner.trl.top_entropy_quantile=0.2"]))  # a free-form node takes any key
