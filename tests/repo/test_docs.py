"""The docs match the code: the config reference is regenerated and compared; every structured-config field is
in the YAML that uses it, with a comment; the README's quick start is the command the tests run."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import CONF, ROOT
from echo2 import config as schema
from echo2.config_reference import options, reference, undocumented


def test_config_reference_is_up_to_date():
    assert (ROOT / "docs" / "config.md").read_text() == reference(), \
        "docs/config.md is stale: python -m echo2.config_reference > docs/config.md"


def test_every_option_is_documented():
    assert undocumented() == []


@pytest.mark.parametrize("node, files", [
    (schema.ModelConfig, "model/*.yaml"), (schema.ArithTaskConfig, "task/arith.yaml"),
    (schema.KuhnTaskConfig, "task/kuhn.yaml"), (schema.Gsm8kTaskConfig, "task/gsm8k.yaml"),
    (schema.ArithChatTaskConfig, "task/arith_chat.yaml"), (schema.DatasetTaskConfig, "task/dataset.yaml"),
    (schema.CalculatorTaskConfig, "task/calculator.yaml"), (schema.PokerTaskConfig, "task/poker.yaml"),
    (schema.LearnerConfig, "learner/default.yaml"), (schema.RolloutConfig, "rollout/*.yaml"),
    (schema.BroadcastConfig, "broadcast/*.yaml"), (schema.ActivationConfig, "activation/default.yaml"),
])
def test_every_schema_field_is_in_its_yaml(node, files):
    fields = {f.name for f in dataclasses.fields(node) if not f.name.startswith("_")}  # _target_, _recursive_
    assert list(CONF.glob(files)), f"no file conf/{files}: the check would pass with nothing checked"
    for path in CONF.glob(files):
        keys = {o.key.split(".")[0] for o in options(path)}
        assert fields <= keys, f"{path.name} lacks {sorted(fields - keys)}"


@pytest.mark.parametrize("node, files, section", [
    (schema.AsyncSourceConfig, "rollout/async.yaml", "source"), (schema.SyncSourceConfig, "rollout/sync.yaml", "source"),
    (schema.LaggedSourceConfig, "rollout/lagged.yaml", "source"),
    (schema.RelayBroadcasterConfig, "broadcast/pipelined.yaml", "sender"),
])
def test_every_component_option_is_in_its_yaml(node, files, section):
    """The options of a component's config node (its schema, read from its constructor) are those its YAML lists."""
    fields = {f.name for f in dataclasses.fields(node) if f.name != "_target_"}
    assert list(CONF.glob(files)), f"no file conf/{files}: the check would pass with nothing checked"
    for path in CONF.glob(files):
        keys = {o.key.split(".")[1] for o in options(path) if o.key.startswith(section + ".")}
        assert keys == fields, f"{path.name}: missing {sorted(fields - keys)}, not options {sorted(keys - fields)}"


def test_run_options_match_the_schema():
    keys = {o.key.split(".", 1)[1] for o in options(CONF / "config.yaml") if o.key.startswith("run.")}
    assert keys == {f.name for f in dataclasses.fields(schema.RunConfig)}


def test_readme_quick_start_is_what_ci_and_the_demo_test_run():
    """The two commands of the README: the test command is .ci/run's; the run command is the default config, which
    tests/e2e/test_async_e2e.py's demo test builds as train.py does (with no override but its heartbeat timeout
    and the test plumbing)."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert commands == ["./install.sh && .venv/bin/python train.py", "./install.sh && .venv/bin/python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./install.sh" in ci and ".venv/bin/python -m pytest\n" in ci
    demo = (ROOT / "tests" / "e2e" / "test_async_e2e.py").read_text()
    assert 'train(tmp_path, ["rollout.source.heartbeat_timeout_s=5"], hook)' in demo


def test_group_descriptions_are_whole_in_the_reference():
    """Every line of every YAML file's opening comment reaches docs/config.md (it once kept only the first)."""
    from echo2.config_reference import header

    ref = reference()
    for path in [CONF / "config.yaml", *CONF.glob("*/*.yaml"), *CONF.glob("hydra/launcher/*.yaml")]:
        text = "\n".join(header(path))
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            words = line.lstrip("#").strip()
            if words and not line.startswith("# @package"):
                assert words in text, (path.name, words)
        assert text and text in ref, path.name


def test_the_repository_stands_alone():
    """No file refers a reader to design notes or research files that are not in the repository."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\bDESIGN\b|shared/|research/")
    hits = [f"{f}:{i}" for f in files if (ROOT / f).is_file() and f != "tests/repo/test_docs.py"
            for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert hits == []
