"""The synchronous on-policy source (staleness S = 0): the baseline the asynchronous system is measured against.

Each learner step it generates G completions per prompt with the learner's own live weights, through an
``Engine`` in the learner's process, and scores them. Every rollout it returns has version == the current
version, so the lag is 0 by construction. It is what TRL's GRPOTrainer does with ``use_vllm=False``, but
with the behaviour logprobs kept and carried as the "old" policy of the loss.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from echo2.metrics import ROLLOUT_GENERATE_S, ROLLOUT_RECEIVED
from echo2.records import Completion, Rollout, RolloutGroup
from echo2.scoring import Scorer
from echo2.seams import Engine, RunParts

log = logging.getLogger(__name__)


class SyncRolloutSource:
    needs_policy = True
    max_staleness = 0  # on-policy by construction
    check_every_steps = 0  # the learner generated every rollout itself: nothing to check
    single_process = False

    def __init__(self, parts: RunParts):
        self.engine: Engine = parts.engine
        self.scorer: Scorer = parts.scorer
        self.task = parts.task
        self.tokenizer, self.sampling = parts.tokenizer, parts.sampling
        self._generated = 0
        self._generate_s = 0.0

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        if policy is None:
            raise ValueError("SyncRolloutSource generates with the learner's policy; collect() got none")
        self.scorer.set_step(version)  # trainer_state.global_step of the reward functions
        t0 = time.perf_counter()
        episodes = self.task.episodes(self.tokenizer) if hasattr(self.task, "episodes") else None
        if episodes is not None:  # a multi-turn task: its episodes run here, with the live policy
            per_row = self._episodes(episodes, rows, version, policy)
        else:
            prompt_ids = [self.task.prompt_ids(self.tokenizer, r) for r in rows]
            completions = self.engine.generate(policy, prompt_ids, self.sampling)
            per_row = [[Rollout(prompt_ids=ids, completion=c, version=version) for c in comps]
                       for ids, comps in zip(prompt_ids, completions, strict=True)]
        self._generate_s = time.perf_counter() - t0
        groups = []
        for row, rollouts in zip(rows, per_row, strict=True):
            groups.append(self.scorer.score(RolloutGroup(row=row, rollouts=rollouts)))
        self._generated += sum(len(g.rollouts) for g in groups)
        return groups

    def _episodes(self, episodes: Any, rows: list[dict[str, Any]], version: int, policy: Any) -> list[list[Rollout]]:
        """G episodes of each row, generated with ``policy`` (echo2/tasks/environments/episode.py)."""
        generate = lambda ids, params: self.engine.generate(policy, ids, params)  # noqa: E731
        runs = episodes.run(generate, rows, self.sampling, self.sampling.n,
                            context_tokens=getattr(getattr(policy, "config", None), "max_position_embeddings", None))
        return [[Rollout(prompt_ids=t.prompt_ids, completion=Completion(t.token_ids, t.logprobs, t.finish_reason,
                                                                          t.mask), version=version, episode=t.record())
                 for t in group] for group in runs]

    def on_version(self, version: int, policy: Any) -> None:
        """Nothing to publish: the next ``collect`` is handed the updated policy itself."""

    def checkpoint(self, kept: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Nothing to keep: the rows come from TRL's sampler, which the learner's checkpoint restores."""
        return {}

    def on_resume(self, version: int, policy: Any) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {ROLLOUT_RECEIVED: float(self._generated), ROLLOUT_GENERATE_S: self._generate_s}

    def request_stop(self) -> None:
        pass  # it never waits: the step in progress ends, then the callback stops the run

    def on_check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        return []

    def close(self) -> dict[str, Any]:
        """Every rollout generated here is consumed by the step that asked for it."""
        getattr(self.task, "close", lambda: None)()  # a task of one's own may have no close()
        n = self._generated
        return {"dispatched": n, "received": n, "consumed": n, "dropped": {}, "lost": {}, "in_flight": 0,
                "buffered": 0}
