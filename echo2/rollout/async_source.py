"""The asynchronous source: rollouts from remote worker agents, each at most S versions stale (DESIGN §2).

    learner step t:  collect() ── coordinator.take(P) ──► P scored groups, every one with t − x ≤ S
                     ...loss, optimizer step...
                     on_version(t+1) ── coordinator.set_version(t+1)  (evicts what became too stale)
                                     └─ every κ steps: coordinator.publish(t+1, snapshot bytes)  (returns at once)

The coordinator and the broadcaster run in a process of their own (service.py), so serving workers takes
neither the learner's GIL nor its core. The learner never generates and never waits for a broadcast; it waits
only when fewer than P admissible groups are buffered (``train/learner_idle_s``). Prompts come from the task's
training set in the coordinator's own seeded order, so the rows TRL's sampler hands to ``collect`` are unused.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from echo2.rollout.protocols import RolloutContext
from echo2.rollout.service import CoordinatorProcess
from echo2.rollout.types import RolloutGroup

log = logging.getLogger(__name__)


class AsyncRolloutSource:
    needs_policy = False

    def __init__(self, ctx: RolloutContext, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_timeout_s: float = 30.0, take_timeout_s: float = 900.0, groups_per_pull: int = 4,
                 coordinator_cores: list[int] | None = None):
        if ctx.publish_interval < 1:
            raise ValueError(f"broadcast.interval={ctx.publish_interval}: must be >= 1")
        s = ctx.sampling
        self.ctx, self.take_timeout_s = ctx, take_timeout_s
        self.pool = ctx.pool
        self.coordinator = CoordinatorProcess(
            task=ctx.task, tokenizer=ctx.tokenizer, make_broadcaster=ctx.make_broadcaster,
            log_path=os.path.join(ctx.run_dir, "coordinator.log"), cores=coordinator_cores, coordinator_kwargs=dict(
                token=ctx.token, staleness=ctx.staleness, prompts_per_step=ctx.prompts_per_step, group_size=s.n,
                vocab_size=len(ctx.tokenizer), host=host, port=port, heartbeat_timeout_s=heartbeat_timeout_s,
                groups_per_pull=groups_per_pull, seed=ctx.seed, sampling={
                    "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
                # a plain dict: Hydra hands dicts in ``ctx`` on as DictConfigs tied to the whole (unpicklable) tree
                activation={k: ctx.activation[k] for k in ctx.activation} if ctx.activation else None))
        self.pool.start(self.coordinator.url, ctx.token, ctx.model_path, ctx.run_dir)

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        # The learner times this call itself (train/learner_idle_s).
        return self.coordinator.take(len(rows), timeout_s=self.take_timeout_s)

    def on_version(self, version: int, policy: Any) -> None:
        self.coordinator.set_version(version)
        if version % self.ctx.publish_interval == 0:
            self.coordinator.publish_state_dict(version, policy.state_dict())

    def metrics(self) -> dict[str, float]:
        return self.coordinator.metrics()  # the coordinator's and the broadcaster's

    def close(self) -> dict[str, Any]:
        self.pool.stop()
        accounting = self.coordinator.close()
        log.info("rollout accounting: %s", accounting)
        return accounting
