"""A task of your own (its YAML in a folder of yours, found with ``hydra.searchpath``): its options are set and swept
from the command line, ``+`` adds one its constructor takes, and the constructor's parameters judge them before
anything starts (names before composing, names, types and required ones once composed)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import compose
from echo2.config import check_overrides, validate

MODULE = '''
from echo2.tasks.base import Task


class MyTask(Task):
    def __init__(self, dataset: str, size: int = 10, note: str = "x", max_completion_length: int = 4):
        self.dataset, self.size, self.note, self.max_completion_length = dataset, size, note, max_completion_length
'''


@pytest.fixture
def own(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "myconf" / "task").mkdir(parents=True)
    (tmp_path / "myconf" / "task" / "mytask.yaml").write_text("_target_: my_tasks.MyTask\ndataset: a\nsize: 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return [f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "task=mytask"]


def test_its_options_are_set_added_and_swept_from_the_command_line(own):
    args = own + ["task.dataset=foo", "+task.note=bar"]
    assert check_overrides(args) == []
    assert check_overrides(own + ["task.size=1,2,3"]) == []  # a sweep (-m) of its option
    cfg = compose(args)
    assert (cfg.task.dataset, cfg.task.size, cfg.task.note) == ("foo", 10, "bar")
    validate(cfg)
    from hydra.utils import instantiate

    assert instantiate(cfg.task).dataset == "foo"


def test_a_typo_is_refused_before_composing_and_a_wrong_type_or_a_missing_option_once_composed(own):
    (why,) = check_overrides(own + ["task.sise=3"])
    assert "task.sise: no such option in task (did you mean task.size?)" in why
    (why,) = check_overrides(own + ["+task.sise=3"])
    assert "did you mean task.size?" in why
    with pytest.raises(ValueError, match=r"task.sise: no such option of my_tasks.MyTask .*did you mean task.size"):
        validate(compose(own + ["+task.sise=3"]))
    with pytest.raises(ValueError, match="'three' of type 'str' could not be converted to Integer"):
        validate(compose(own + ["task.size=three"]))
    with pytest.raises(ValueError, match="task.dataset: my_tasks.MyTask needs it"):
        validate(compose(own + ["~task.dataset"]))


def test_built_in_tasks_keep_their_schemas(own):
    assert "did you mean task.level?" in check_overrides(["task.levle=copy"])[0]
    assert check_overrides(["task=dataset", "task.data_files=x.jsonl", "+task.chat_template_kwargs.enable_thinking=false"
                            ]) == []
    assert "no such option in task" in check_overrides(["task=dataset", "task.dataset=foo"])[0]
