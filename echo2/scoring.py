"""Rewards, computed on the learner's side (a worker never sends a reward the learner trusts).

Applies a task's TRL-style reward functions to a group, and sums them with the task's weights. Each function is
called as TRL's GRPOTrainer calls it (echo2/tasks/rewards.py: the keyword arguments, ``trainer_state``,
``log_metric``/``log_extra``, async functions). A function returning ``None`` for a completion abstains; if all
abstain the reward is NaN (TRL's convention), which the learner turns into a zero advantage. A function that raises
abstains on that group and its error travels with the group (``reward/errors``); a group on which every function
failed is not scored (``reward_error``). The coordinator process runs the functions in a pool of processes of their
own, with a time limit per group (echo2/coordinator/reward_pool.py); the learner's own sources call ``Scorer`` in
place.

What a reward process is sent for one group is a ``job`` (plain data: the row, the decoded completions, their token
ids, the trainer state); what it answers is ``{"rewards": {name: [value]}, "logs": {...}}``, which ``apply`` sets on
the group.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

from echo2.records import RolloutGroup
from echo2.tasks.base import Task, encode_prompt  # noqa: F401 (encode_prompt: imported from here too)
from echo2.tasks.rewards import EXCLUDED_COLUMNS, RewardLog, TrainerStateView, call_rewards, unique_names

log = logging.getLogger(__name__)


MAX_REPORTED = 256
"""Distinct failures (a reward function's error, an environment's) logged once each, up to this many; every one is
counted in the learner's metrics (reward/errors/<name>, rollout/env_errors) whether logged or not."""


class RewardsFailed(RuntimeError):
    """Every reward function failed on a group: it cannot be scored (``reward_error``)."""


class RewardFunctions:
    """A task's reward functions and weights, without a tokenizer: what a reward process
    (echo2/coordinator/reward_pool.py) holds. ``max_steps`` and ``steps_per_epoch`` fill ``trainer_state``; its
    ``global_step`` is set with ``set_step`` by whoever scores (the learner's version at the time)."""

    def __init__(self, task: Task, max_steps: int = 0, steps_per_epoch: float = 0.0):
        self.task = task
        self.funcs = task.reward_funcs()
        self.func_names = unique_names(self.funcs)
        # learner.trl.reward_weights (TRL's name), set on the task by train.py, else the task's own
        self.weights = list(getattr(task, "reward_weights_override", None) or task.reward_weights())
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"task {task.name}: {len(self.funcs)} reward funcs but {len(self.weights)} weights")
        # a multi-turn task's environment reward: one more column, weight 1 (as TRL adds get_reward); with several
        # environments one per class, each scoring only its own environment's rollouts (None for the others, as TRL)
        self.spec = task.episode_spec()
        self.env_columns = self.spec.reward_columns() if self.spec is not None else []
        self.names = self.func_names + self.env_columns
        self.weights += [1.0] * len(self.env_columns)
        self.max_steps, self.steps_per_epoch = max_steps, steps_per_epoch
        self.state = TrainerStateView(max_steps=max_steps)
        self._reported: set[tuple[str, str]] = set()  # (function, error) pairs already logged
        self._episodes: Any = None  # the episodes' runtime, for reading transcripts back (check_transcripts)

    def set_step(self, global_step: int) -> None:
        """The learner's version now: what ``trainer_state.global_step`` says to the groups scored from now on."""
        self.state = self.state_at(global_step)

    def state_at(self, global_step: int) -> TrainerStateView:
        epoch = global_step / self.steps_per_epoch if self.steps_per_epoch > 0 else 0.0
        return TrainerStateView(global_step=global_step, max_steps=self.max_steps, epoch=epoch)

    def read_transcripts(self, tokenizer: Any, group: RolloutGroup) -> None:
        """Read each episode's transcript back from its tokens (echo2/tasks/environments/episode.py): the model's
        turns parsed, the environment's messages checked against the tokens they were rendered to (TranscriptMismatch
        if not). Where workers' results are taken in, before scoring; nothing to do for single-turn rollouts."""
        if self.spec is None or not any(r.episode is not None for r in group.rollouts):
            return
        if self._episodes is None:
            self._episodes = self.task.episodes(tokenizer)
        environment = self.spec.environment_of(group.row)
        for r in group.rollouts:
            c = r.completion
            r.episode["messages"] = self._episodes.transcript(r.prompt_ids, c.token_ids, c.mask or [1] * len(
                c.token_ids), r.episode, group.row.get("prompt"), environment)
            error = r.episode.get("error")
            if error and ("environment", error) not in self._reported and len(self._reported) < MAX_REPORTED:
                self._reported.add(("environment", error))
                log.warning("an episode of group %s ended early (it abstains from rewards; counted in "
                            "rollout/env_errors): %s", group.group_id or "?", error)

    def job(self, group: RolloutGroup, judge: bool = False) -> dict[str, Any]:
        """What scoring ``group`` needs, as plain data (sent to a reward process): its row, decoded completions and
        token ids, the trainer state, and a multi-turn group's episode records (with their transcripts). ``judge``: a
        held-out row, to be judged (``"judge"``), at the state of the version that generated it (a worker's
        evaluation may answer after the learner moved on)."""
        state = self.state_at(group.rollouts[0].version) if judge and group.rollouts else self.state
        job = {"row": group.row, "texts": [r.text for r in group.rollouts],
               "completion_ids": [r.completion.token_ids for r in group.rollouts], "state": state,
               **({"judge": True} if judge else {})}
        if any(r.episode is not None for r in group.rollouts):
            job["episodes"] = [r.episode or {} for r in group.rollouts]
        return job

    def compute_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """Each function's value for each completion, ``{"rewards": {name: [value or NaN]}, "logs": ...}`` (None, an
        abstention, is NaN). Raises RewardsFailed if every function failed. An episode's completion is its transcript
        (the model's turns and the environment's messages, as TRL hands multi-turn completions), its prompt the one
        the environment started from; a failed episode abstains from every reward."""
        row, texts = job["row"], job["texts"]
        n = len(texts)
        episodes = job.get("episodes")
        prompts = [row["prompt"]] * n
        completions: list[Any] = list(texts)
        if episodes:
            prompts = [e.get("prompt") or row["prompt"] for e in episodes]
            completions = [list(e.get("messages") or []) for e in episodes]
        elif not isinstance(row["prompt"], str):  # chat messages: TRL hands rewards conversational completions
            completions = [[{"role": "assistant", "content": c}] for c in texts]
        kwargs = {k: [v] * n for k, v in row.items() if k not in EXCLUDED_COLUMNS}
        kwargs.update(prompts=prompts, completions=completions, completion_ids=job["completion_ids"],
                      trainer_state=job["state"])
        environment = self.spec.environment_of(row) if self.spec is not None else None
        if episodes and self.spec is not None and self.spec.path(environment):
            from echo2.tasks.environments import EnvironmentView

            name = self.spec.path(environment).replace(":", ".").rpartition(".")[2]
            kwargs["environments"] = [EnvironmentView(name, e.get("state") or {}, e.get("reward"), e.get("error"))
                                      for e in episodes]
        logs = RewardLog()
        rewards = call_rewards(self.funcs, self.func_names, n, kwargs, logs)
        if self.funcs and len(logs.errors) == len(self.funcs):
            raise RewardsFailed("every reward function failed: " + "; ".join(f"{k}: {v}" for k, v in
                                                                              logs.errors.items()))
        own = self.spec.reward_column(environment) if self.spec is not None else None
        for column in self.env_columns:  # the row's environment's own reward; NaN in the others' columns
            rewards[column] = [math.nan if column != own or e.get("reward") is None else float(e["reward"])
                               for e in (episodes or [{}] * n)]
        for i, e in enumerate(episodes or []):
            if e.get("error"):  # the environment failed: nothing to learn from this one
                for values in rewards.values():
                    values[i] = math.nan
        return {"rewards": rewards, "logs": logs.as_dict()}

    def judge_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """Whether each completion of ``job`` solves its row's problem (what ``eval/accuracy`` counts), ``{"correct":
        [bool], "values": [float]}``: the task's ``is_correct`` (handed the token ids and the trainer state, the
        job's or this judge's, where it takes them); a multi-turn task's episodes by its eval reward column reaching
        its threshold (``correct_when``), NaN (not correct) where every reward failed. The learner's evaluator and the
        coordinator's (workers) both judge here."""
        if job.get("episodes"):
            takes_row = len(inspect.signature(self.task.correct_when).parameters) > 0
            name, threshold = self.task.correct_when(job["row"]) if takes_row else self.task.correct_when()
            try:  # no column (a row whose environment has no reward of its own): nothing solves it, as TRL's None
                values = [float(v) for v in self.compute_job(job)["rewards"].get(name) or [math.nan] * len(
                    job["texts"])]
            except RewardsFailed:
                values = [math.nan] * len(job["texts"])
            return {"correct": [bool(v >= threshold) for v in values], "values": values}
        takes = inspect.signature(self.task.is_correct).parameters
        state = {"trainer_state": job.get("state", self.state)} if "trainer_state" in takes else {}
        with_ids = "completion_ids" in takes
        correct = [bool(self.task.is_correct(text, job["row"], **state, **({"completion_ids": ids} if with_ids else {})))
                   for text, ids in zip(job["texts"], job["completion_ids"], strict=True)]
        return {"correct": correct, "values": [float(c) for c in correct]}

    def apply_judgement(self, group: RolloutGroup, value: dict[str, Any]) -> RolloutGroup:
        """``judge_job``'s answer on the group's rollouts: ``rewards["correct"]`` (1.0 or 0.0) and ``reward`` the
        value judged (an episode's eval reward, else the same 1.0 or 0.0)."""
        for r, correct, v in zip(group.rollouts, value["correct"], value["values"], strict=True):
            r.rewards, r.reward = {"correct": float(bool(correct))}, float(v)
        return group

    def compute(self, row: dict, completions: list[str], completion_ids: list[list[int]]) -> dict[str, Any]:
        """``compute_job`` for a group given by its parts (the row, the decoded completions, their token ids)."""
        return self.compute_job({"row": row, "texts": completions, "completion_ids": completion_ids,
                                 "state": self.state})

    def apply(self, group: RolloutGroup, value: dict[str, Any]) -> RolloutGroup:
        """Set each rollout's rewards and their weighted sum (NaN if every function abstained), and the group's
        reward logs (what the functions logged, and the errors of those that failed)."""
        per_func = value["rewards"]
        for i, r in enumerate(group.rollouts):
            r.rewards = {name: vals[i] for name, vals in per_func.items()}
            vals = [w * v for w, v in zip(self.weights, r.rewards.values()) if not math.isnan(v)]
            r.reward = sum(vals) if vals else math.nan
        group.reward_logs = value.get("logs") or {}
        for name, error in (group.reward_logs.get("errors") or {}).items():
            if (name, error) not in self._reported and len(self._reported) < MAX_REPORTED:
                self._reported.add((name, error))
                log.warning("reward %s failed on group %s (it abstains there; counted in reward/errors): %s", name,
                            group.group_id or "?", error)
        return group


class Scorer(RewardFunctions):
    """Scores in the calling thread (the learner's own sources, and coordinators in tests); the coordinator
    process scores in a RewardPool instead, which has the same ``score_many``."""

    def __init__(self, task: Task, tokenizer: Any, max_steps: int = 0, steps_per_epoch: float = 0.0):
        super().__init__(task, max_steps, steps_per_epoch)
        self.tokenizer = tokenizer

    def score(self, group: RolloutGroup, judge: bool = False) -> RolloutGroup:
        """Score ``group`` in place (``judge``: judge it instead, as held-out rows are: apply_judgement)."""
        decode(self.tokenizer, group)
        if any(r.episode is not None and "messages" not in r.episode for r in group.rollouts):
            self.read_transcripts(self.tokenizer, group)
        if judge:
            return self.apply_judgement(group, self.judge_job(self.job(group, judge=True)))
        return self.apply(group, self.compute_job(self.job(group)))

    def check_transcripts(self, group: RolloutGroup) -> None:
        """A worker's episodes read back against their tokens (read_transcripts), where its results are taken in."""
        self.read_transcripts(self.tokenizer, group)

    def score_many(self, groups: list[RolloutGroup], principal: str | None = None,
                   judge: bool = False) -> list[str | None]:
        """Score each group in place; per group None, or why it could not be (``reward_error``: every reward
        failed). ``principal``: who sent them (a reward pool orders and charges by it; here, in the caller's thread,
        unused). ``judge``: judge them instead (held-out rows: ``apply_judgement``)."""
        reasons: list[str | None] = []
        for group in groups:
            try:
                self.score(group, judge)
                reasons.append(None)
            except Exception as e:
                log.warning("reward failed on group %s: %s: %s", group.group_id, type(e).__name__, e)
                reasons.append("reward_error")
        return reasons

    def metrics(self) -> dict[str, float]:
        return {}  # scores in the caller's thread: nothing to count beyond the coordinator's own books

    def close(self) -> None:
        pass


def decode(tokenizer: Any, group: RolloutGroup) -> None:
    """Each rollout's text, as the reward functions read it."""
    for r in group.rollouts:
        r.text = tokenizer.decode(r.completion.token_ids, skip_special_tokens=True)


def longest_prompt(tokenizer: Any, prompts: list[Any]) -> int:
    """Tokens in the longest of ``prompts`` (as encode_prompt counts them): what a worker's context must hold before
    the completion. Plain strings are tokenized in one batch."""
    text = [p for p in prompts if isinstance(p, str)]
    longest = max(map(len, tokenizer(text)["input_ids"]), default=0) if text else 0
    return max([longest, *(len(encode_prompt(tokenizer, p)) for p in prompts if not isinstance(p, str))])
