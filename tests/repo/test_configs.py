"""Every option of every group composes and passes validation; the tiny model, the arith and gsm8k tasks and the
hub models' ids instantiate; typos, wrong types and impossible settings fail early, naming the key."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import CONF, FIXTURES, ROOT, compose
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


@pytest.mark.parametrize("override", ["rollout.stalenes=4", "learner.lr=1e-3", "task.levle=copy", "run.step=3",
                                      "rollout.source.hots=0.0.0.0", "rollout.source.liveness.flor_s=1",
                                      "broadcast.sender.fanuot=3", "broadcast=one_to_many broadcast.sender.prot=1"])
def test_typo_fails_at_compose_time(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose(override.split())


def test_wrong_types_under_the_components_fail_at_compose_time():
    for override in ("rollout.source.port=eighty", "rollout.source.liveness.share=half", "broadcast.sender.fanout=x"):
        with pytest.raises((ConfigCompositionException, ValidationError)):
            compose([override])


def test_the_components_schemas_are_read_from_their_constructors():
    """One place for each default: the source's and the broadcaster's constructors. A composed config carries their
    defaults and types, and the YAML's values where it sets them."""
    import inspect

    from echo2.config import AsyncSourceConfig, RelayBroadcasterConfig, schema_of
    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.learner.sources.async_source import AsyncRolloutSource
    from echo2.settings import LivenessSettings

    for cls, schema in ((AsyncRolloutSource, AsyncSourceConfig), (RelayBroadcaster, RelayBroadcasterConfig)):
        params = {n: p.default for n, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
        fields = {f.name: f for f in dataclasses.fields(schema) if f.name != "_target_"}
        assert set(fields) == set(params) - {"link", "liveness", "state_dir"} | ({"liveness"} if "liveness" in params else set())
        for name, f in fields.items():
            if name != "liveness":
                assert f.default == params[name], name
    liveness = AsyncSourceConfig().liveness
    assert dataclasses.asdict(liveness) == dataclasses.asdict(LivenessSettings())

    class Thing:
        def __init__(self, parts, *, rate: float = 2.5, hosts: list[str] | None = None, mode: str | None = "a"):
            pass

    thing = schema_of(Thing)()
    assert (thing._target_.endswith("Thing"), thing.rate, thing.hosts, thing.mode) == (True, 2.5, None, "a")
    cfg = compose(["rollout.source.port=7001", "rollout.source.liveness.share=0.25", "broadcast.sender.fanout=3"])
    assert (cfg.rollout.source.port, cfg.rollout.source.liveness.share, cfg.broadcast.sender.fanout) == (7001, 0.25, 3)
    assert cfg.rollout.source.liveness.strikes == 3 and cfg.broadcast.sender.chunk_mb == 4


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
    ("rollout.source.min_worker=2", "did you mean rollout.source.min_workers"),
    ("rollout.source.liveness.strike=2", "did you mean rollout.source.liveness.strikes"),
    ("broadcast.sender.fanuot=3", "did you mean broadcast.sender.fanout"),
    ("rollout.source.deadline_floor_s=1", "no such option in rollout.source"),
])
def test_an_override_that_names_no_option_is_refused_before_composing(override, why):
    from echo2.config import check_overrides

    errors = check_overrides([override])
    assert len(errors) == 1 and why in errors[0] and "+" not in errors[0], errors


def test_a_component_of_your_own_takes_its_own_options():
    """``_target_`` may name a source or broadcaster of your own: keys added with ``+`` below it pass the check before
    composing, and validate() leaves them to its constructor; the same key under the registered class is refused."""
    from echo2.config import check_overrides, unknown_keys

    own = ["broadcast.sender._target_=benchmarks.coordinator_crowd.NullBroadcaster", "+broadcast.sender.version_file=v"]
    assert check_overrides(own) == [] and unknown_keys(compose(own)) == []
    assert unknown_keys(compose(own[1:])) == ["broadcast.sender.version_file: no such option in broadcast.sender; "
                                              "every option is listed in docs/config.md"]


def test_a_mistyped_key_in_an_experiment_file_is_refused_before_composing_with_a_near_option(tmp_path):
    """Hydra refuses it too, but names no near key; a sweep's keys are judged as overrides; a component of your own
    keeps its options; the shipped experiments pass."""
    from echo2.config import CONF_DIR, check_experiments

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /task: kuhn\nrollout:\n  staleness: 2\n  source:\n    hots: 2\n"
        "    liveness:\n      strike: 3\nrun:\n  stepz: 3\nhydra:\n  sweeper:\n    params:\n      sede: 0,1\n"
        "      rollout.staleness: 0,4\n")
    (tmp_path / "experiment" / "own.yaml").write_text(
        "# @package _global_\nbroadcast:\n  sender:\n    _target_: my.Broadcaster\n    version_file: v\n")
    errors = check_experiments(["-m", "experiment=typo,own", "seed=1"], tmp_path)
    assert [e.split(": no such option")[0] for e in errors] == [
        "experiment/typo.yaml: sede", "experiment/typo.yaml: rollout.source.hots",
        "experiment/typo.yaml: rollout.source.liveness.strike", "experiment/typo.yaml: run.stepz"], errors
    assert "did you mean rollout.source.host?" in errors[1] and "did you mean run.steps?" in errors[3], errors
    shipped = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    assert shipped and check_experiments([f"experiment={','.join(shipped)}"]) == []


@pytest.mark.e2e  # starts train.py
def test_train_py_names_a_near_option_for_a_typo_in_an_experiment_file(tmp_path):
    """An experiment file of your own, in a folder on Hydra's search path (never written into conf/, which other
    tests read at the same time)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "zz_test_typo.yaml").write_text("# @package _global_\nrollout:\n  stalenes: 3\n")
    out = subprocess.run([sys.executable, "train.py", f"hydra.searchpath=[file://{tmp_path}]", "experiment=zz_test_typo",
                          "--cfg", "job"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "did you mean rollout.staleness?" in out.stderr, out.stderr[-2000:]
    assert "experiment/zz_test_typo.yaml: rollout.stalenes" in out.stderr, out.stderr[-2000:]  # echo2's check, not Hydra's


@pytest.mark.parametrize("override", [
    "rollout.staleness=4", "rollout=sync", "hydra/launcher=slurm", "experiment=mod10",
    "+learner.trl.top_entropy_quantile=0.2",
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
