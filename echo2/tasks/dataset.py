"""A dataset and reward functions, as TRL takes them: ``task=dataset``.

The dataset is read with ``datasets.load_dataset``: a hub id (``trl-lib/DeepMath-103K``), a local folder, or local
files (``task.data_files``: json, jsonl, csv, parquet; one file, a list, or ``{split: files}``). Rows are in TRL's
formats: *standard* (``prompt`` is a string) or *conversational* (``prompt`` is a list of chat messages); the other
columns are handed to every reward function as keyword arguments, one value per completion, as TRL does
(``task.prompt_column`` names another prompt column). The reward functions are named by import path, TRL's own or
a module of yours, with arguments and weights (echo2/tasks/rewards.py)::

    python train.py task=dataset task.data_files=data/train.jsonl \\
        'task.reward_funcs=[trl.rewards.accuracy_reward,trl.rewards.think_format_reward]' \\
        'task.reward_weights=[1.0,0.2]' +task.chat_template_kwargs.enable_thinking=false

Held-out rows (``eval/accuracy``): the ``task.eval_split`` split, or, without one, ``task.eval_size`` rows drawn
(seeded) from the training split and left out of training. A held-out completion counts as correct when the reward
function ``task.eval_reward`` (default: the first one) gives it at least ``task.eval_threshold``.

``task.chat_template_kwargs`` go to the chat template wherever a prompt becomes token ids (echo2/tasks/base.py), as
TRL's ``GRPOConfig.chat_template_kwargs`` do.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from datasets import Dataset

from echo2.tasks.base import RewardFunc, Task
from echo2.tasks.rewards import EXCLUDED_COLUMNS, RewardLog, TrainerStateView, call_rewards, resolve, unique_names

log = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
            ".txt": "text"}
"""The ``datasets`` builder for local files, by extension."""


def plain(value: Any) -> Any:
    """A config value as plain Python (Hydra hands a constructor DictConfig / ListConfig nodes): picklable, and
    what reward functions and chat templates expect."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _files(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _files(v)]
    return [str(f) for f in data_files or []]


def _absolute(data_files: Any) -> Any:
    """Local file paths made absolute, so that the coordinator's process (and a resumed run) reads the same files."""
    if isinstance(data_files, str):
        return str(Path(data_files).expanduser().resolve()) if Path(data_files).expanduser().exists() else data_files
    if isinstance(data_files, dict):
        return {k: _absolute(v) for k, v in data_files.items()}
    return [_absolute(f) for f in data_files] if data_files is not None else None


PLACEHOLDER_ROWS = 1024
"""Rows of an empty prompt when a TRL environment owns the data (no dataset): each rollout's prompt is what its
``reset`` returns, so the number only sets how often an epoch passes (TRL makes one generation batch's worth)."""


class DatasetTask(Task):
    def __init__(self, path: str | None = None, data_files: str | list[str] | dict[str, Any] | None = None,
                 config_name: str | None = None, train_split: str = "train", eval_split: str | None = None,
                 eval_size: int = 200, prompt_column: str = "prompt", system_prompt: str | None = None,
                 reward_funcs: list[Any] | None = None, reward_weights: list[float] | None = None,
                 eval_reward: str | None = None, eval_threshold: float = 1.0,
                 chat_template_kwargs: dict[str, Any] | None = None, max_completion_length: int = 256, seed: int = 0,
                 environment: str | dict[str, str] | None = None, tools: list[str] | None = None,
                 environment_config: dict[str, Any] | None = None, max_turns: int | None = None,
                 max_turn_tokens: int | None = None, environment_timeout_s: float = 60.0,
                 environment_reward: bool = True):
        self.data_files = _absolute(plain(data_files))
        if path is not None and Path(path).expanduser().exists():
            path = str(Path(path).expanduser().resolve())
        self.path, self.config_name = path, config_name
        self.train_split, self.eval_split, self.eval_size, self.seed = train_split, eval_split, eval_size, seed
        self.prompt_column, self.system_prompt = prompt_column, system_prompt
        self.reward_specs = list(plain(reward_funcs) or [])
        self.eval_reward, self.eval_threshold = eval_reward, eval_threshold
        self.chat_template_kwargs = dict(plain(chat_template_kwargs) or {})
        self.max_completion_length = max_completion_length
        self.name = f"dataset:{Path(path).name if path else Path((_files(self.data_files) or ['?'])[0]).name}"
        if eval_size < 0:
            raise ValueError(f"task.eval_size={eval_size}: must be >= 0")
        self._funcs: list[RewardFunc] | None = None
        self._splits: tuple[Dataset, Dataset | None] | None = None
        self._episodes: dict[int, Any] = {}  # per tokenizer (id): the runtime of the episodes
        self.spec = self._spec(plain(environment), list(plain(tools) or []), plain(environment_config), max_turns,
                               max_turn_tokens, environment_timeout_s, environment_reward)
        # TRL's environment that owns its data: no dataset, rows of an empty prompt that reset() fills
        self.placeholder = path is None and not self.data_files and type(self).source is DatasetTask.source
        if self.placeholder:
            if self.spec and self.spec.environments:
                raise ValueError(f"task.environment names several environments: each row's {self.spec.selector} "
                                 "column picks one, so the task needs a dataset (task.path or task.data_files), as "
                                 "TRL's dict environment_factory needs a train_dataset")
            if not (self.spec and self.spec.contract == "trl" and self.spec.environment):
                raise ValueError("task=dataset: set task.path (a hub id or a local folder) or task.data_files (local "
                                 "json, jsonl, csv or parquet files); only a TRL environment (task.environment) may go "
                                 "without one, its reset() making each rollout's prompt")
            if eval_split is not None or prompt_column != "prompt":
                raise ValueError("task.eval_split / task.prompt_column name a dataset's: without one (the environment "
                                 "owns the data) held-out rows are task.eval_size draws of the environment's")
            self.name = f"environment:{self.spec.environment.rsplit(':', 1)[-1].rsplit('.', 1)[-1]}"
        # fail here, in the learner, on a reward function that does not import (not in the coordinator's processes)
        names = unique_names(self.reward_funcs())
        if not names and not (self.spec and self.spec.reward_columns()):
            raise ValueError("task.reward_funcs is empty: name at least one reward function, e.g. "
                             "'task.reward_funcs=[trl.rewards.accuracy_reward]' (or an environment with its own "
                             "reward)")
        weights = plain(reward_weights)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(names)
        if len(self.weights) != len(names):
            raise ValueError(f"task.reward_weights has {len(self.weights)} weights for {len(names)} reward functions "
                             f"({', '.join(names)})")
        if eval_reward is not None and eval_reward not in names:
            raise ValueError(f"task.eval_reward={eval_reward!r}: not one of the reward functions ({', '.join(names)})")

    def _spec(self, environment: str | dict | None, tools: list[str], config: dict | None, max_turns: int | None,
              max_turn_tokens: int | None, timeout_s: float, environment_reward: bool) -> Any:
        """The episodes' spec (echo2/tasks/environments/), read here from the classes and functions named, so that an
        import path that does not import fails at once; None without an environment or tools."""
        if environment is None and not tools:
            if config or max_turns is not None or max_turn_tokens is not None:
                raise ValueError("task.environment_config / task.max_turns / task.max_turn_tokens need "
                                 "task.environment or task.tools")
            return None
        from echo2.tasks.environments import spec_for

        if max_turns is not None and max_turns < 1:
            raise ValueError(f"task.max_turns={max_turns}: must be >= 1 (null: no limit)")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"task.max_turn_tokens={max_turn_tokens}: must be >= 1 (null: what is left of "
                             "task.max_completion_length)")
        if not timeout_s > 0:
            raise ValueError(f"task.environment_timeout_s={timeout_s}: must be > 0")
        spec = spec_for(environment, tools, self.max_completion_length, max_turns=max_turns,
                        max_turn_tokens=max_turn_tokens, timeout_s=timeout_s,
                        environment_config=dict(config or {}), chat_template_kwargs=dict(self.chat_template_kwargs))
        if environment_reward:
            return spec
        return replace(spec, environment_reward=None, environment_rewards=dict.fromkeys(spec.environment_rewards))

    def __getstate__(self) -> dict[str, Any]:
        # sent to the coordinator and its reward processes: they rebuild the functions and reload the data
        return {**self.__dict__, "_funcs": None, "_splits": None, "_episodes": {}}

    # ------------------------------------------------------------------ episodes

    def episode_spec(self) -> Any:
        return self.spec

    def episodes(self, tokenizer: Any) -> Any:
        """The episodes' runtime for ``tokenizer`` (echo2/tasks/environments/episode.py), or None without an
        environment or tools."""
        if self.spec is None:
            return None
        if id(tokenizer) not in self._episodes:
            from echo2.tasks.environments import Episodes

            self._episodes[id(tokenizer)] = Episodes(self.spec, tokenizer)
        return self._episodes[id(tokenizer)]

    def close(self) -> None:
        """End the pooled environments of this process's episodes (the learner's, for rollout=sync and evaluation)."""
        for episodes in self._episodes.values():
            episodes.close()

    def prompt_ids(self, tokenizer: Any, row: dict[str, Any]) -> list[int]:
        episodes = self.episodes(tokenizer)
        if episodes is None:
            return super().prompt_ids(tokenizer, row)
        return episodes.prompt_ids(row["prompt"], self.spec.environment_of(row))

    # ------------------------------------------------------------------ data

    def source(self) -> Any:
        """The dataset's splits (a ``DatasetDict``), as ``datasets.load_dataset`` reads them; a task that generates its
        rows (task=calculator, task=poker) overrides this."""
        from datasets import load_dataset

        path, files = self.path, self.data_files
        if path is None:
            suffix = Path(_files(files)[0]).suffix.lower()
            if suffix not in BUILDERS:
                raise ValueError(f"task.data_files: cannot tell the format of {_files(files)[0]!r} (expected one of "
                                 f"{', '.join(BUILDERS)}); set task.path to the datasets builder (json, csv, parquet)")
            path = BUILDERS[suffix]
        elif Path(path).is_file():
            path, files = BUILDERS.get(Path(path).suffix.lower(), "json"), path
        return load_dataset(path, self.config_name, data_files=files)

    def _load(self) -> tuple[Dataset, Dataset | None]:
        if self._splits is not None:
            return self._splits
        if self.placeholder:  # TRL's placeholder rows (GRPOTrainer without a train_dataset); held-out ones alike
            self._splits = self._placeholder(PLACEHOLDER_ROWS), (self._placeholder(self.eval_size) if self.eval_size
                                                                  else None)
            return self._splits
        splits = self.source()
        if self.train_split not in splits:
            raise ValueError(f"task.train_split={self.train_split!r}: the dataset has splits {sorted(splits)}")
        train = self._rows(splits[self.train_split])
        held_out = None
        if self.eval_split is not None:
            if self.eval_split not in splits:
                raise ValueError(f"task.eval_split={self.eval_split!r}: the dataset has splits {sorted(splits)}")
            held_out = self._rows(splits[self.eval_split])
            held_out = held_out.select(range(min(self.eval_size, len(held_out)))) if self.eval_size else held_out
        elif self.eval_size:
            if len(train) <= self.eval_size:
                raise ValueError(f"task.eval_size={self.eval_size} rows held out of a training split of {len(train)}: "
                                 "set task.eval_split, a smaller task.eval_size, or 0 (and run.eval_every_steps=0)")
            parts = train.train_test_split(test_size=self.eval_size, seed=self.seed)
            train, held_out = parts["train"], parts["test"]
        self._splits = train, held_out
        return self._splits

    def _placeholder(self, n: int) -> Dataset:
        """``n`` rows of an empty user message (after ``system_prompt``, if set), for ``reset()`` to fill."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return Dataset.from_dict({"prompt": [[*system, {"role": "user", "content": ""}]] * n})

    def _rows(self, ds: Dataset) -> Dataset:
        """TRL's layout: the prompt in ``prompt`` (renamed from ``prompt_column``), a system message first if asked."""
        if self.prompt_column not in ds.column_names:
            raise ValueError(f"task.prompt_column={self.prompt_column!r}: the dataset has columns {ds.column_names}")
        if self.prompt_column != "prompt":
            if "prompt" in ds.column_names:
                ds = ds.remove_columns("prompt")
            ds = ds.rename_column(self.prompt_column, "prompt")
        first = ds[0]["prompt"] if len(ds) else ""
        conversational = isinstance(first, list)
        if not conversational and not isinstance(first, str):
            raise ValueError(f"the prompt column holds {type(first).__name__}: expected a string (TRL's standard "
                             "format) or a list of chat messages (its conversational format)")
        if self.system_prompt is not None:
            if not conversational:
                raise ValueError("task.system_prompt needs conversational prompts (lists of chat messages)")
            system = {"role": "system", "content": self.system_prompt}
            ds = ds.map(lambda r: {"prompt": [system, *[m for m in r["prompt"] if m["role"] != "system"]]})
        if self.spec is not None and self.spec.environments:
            column = self.spec.selector
            if column not in ds.column_names:
                raise ValueError(f"task.environment names several environments ({', '.join(self.spec.environments)}):"
                                 f" each row's {column} column picks its own, and the dataset has none (columns: "
                                 f"{', '.join(ds.column_names)})")
            unknown = sorted({str(n) for n in ds.unique(column)} - set(self.spec.environments))
            if unknown:
                raise ValueError(f"the dataset's rows name {column} {', '.join(unknown)}: not among "
                                 f"task.environment's {', '.join(self.spec.environments)}")
        elif self.spec is not None and self.spec.contract == "skyrl" and "env_class" in ds.column_names:
            self._check_env_classes(ds.unique("env_class"))
        return ds

    def _check_env_classes(self, names: list[Any]) -> None:
        """SkyRL picks each row's environment by its ``env_class``; a task of one environment runs it on every row,
        so rows that name another are refused here rather than run in the wrong one."""
        from echo2.tasks.environments.contracts import environment_path

        def path(name: str) -> str | None:
            try:
                return environment_path(name)
            except ValueError:  # neither an import path nor a registered id: another environment than the task's
                return None

        other = sorted({str(n) for n in names if n is not None and path(str(n)) != self.spec.environment})
        if other:
            raise ValueError(f"the dataset's rows name env_class {', '.join(other)}, but the task runs "
                             f"task.environment={self.spec.environment} on every row: name every env_class the rows "
                             "use, task.environment={env_class: package.module:Class or a registered id, ...}")

    def train_dataset(self) -> Dataset:
        return self._load()[0]

    def eval_dataset(self) -> Dataset:
        held_out = self._load()[1]
        if held_out is None:
            raise ValueError("task=dataset has no held-out rows (task.eval_size=0 and no task.eval_split): set one, "
                             "or run.eval_every_steps=0")
        return held_out

    # ------------------------------------------------------------------ scoring

    def reward_funcs(self) -> list[RewardFunc]:
        if self._funcs is None:
            self._funcs = [resolve(spec) for spec in self.reward_specs]
        return self._funcs

    def reward_weights(self) -> list[float]:
        return list(self.weights)

    def correct_when(self, row: dict[str, Any] | None = None) -> tuple[str, float]:
        """What counts as correct on held-out rows: the reward column (``eval_reward``; default: the first reward
        function, else the environment's own reward, the row's environment's among several) and the value it must
        reach."""
        names = unique_names(self.reward_funcs())
        name = self.eval_reward or (names[0] if names else self.spec.reward_column(self.spec.environment_of(row)))
        return name, self.eval_threshold

    def is_correct(self, completion: str, row: dict[str, Any], completion_ids: list[int] | None = None,
                   trainer_state: TrainerStateView | None = None) -> bool:
        """Whether the ``eval_reward`` function (default: the first) gives ``completion`` at least ``eval_threshold``;
        an abstention (None) or a failure is not correct. ``trainer_state``: the learner's at the evaluation, as TRL
        hands its state to rewards when it evaluates (a reward with a schedule judges at that step)."""
        funcs = self.reward_funcs()
        names = unique_names(funcs)
        name = self.eval_reward or names[0]
        func = funcs[names.index(name)]
        conversational = not isinstance(row["prompt"], str)
        kwargs = {k: [v] for k, v in row.items() if k not in EXCLUDED_COLUMNS}
        kwargs.update(prompts=[row["prompt"]], completion_ids=[list(completion_ids or [])],
                      completions=[[{"role": "assistant", "content": completion}] if conversational else completion],
                      trainer_state=trainer_state or TrainerStateView())
        logs = RewardLog()
        (value,) = call_rewards([func], [name], 1, kwargs, logs)[name]
        if logs.errors:
            log.warning("eval reward %s failed: %s", name, logs.errors[name])
        return value >= self.eval_threshold  # NaN (abstained or failed) compares False

