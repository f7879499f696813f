"""The seams between the learner and the rollout plane. The learner imports these, never implementations.

A source is built by train.py from its config options plus, by name, the run's parts its constructor asks for
(``task``, ``tokenizer``, ``scorer``, ``sampling``, ``engine``, ``model_path``, ``run_dir``, ``seed``, ``staleness``,
``prompts_per_step``, ``publish_interval``, ``token``, ``make_broadcaster``, ``pool``, ``activation``,
``broadcast_shape``, ``resume``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from echo2.rollout.types import Completion, RolloutGroup, SamplingParams


class Engine(Protocol):
    """Generates completions with behaviour logprobs."""

    def generate(
        self, policy: Any, prompt_ids: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """Called by a source with token-id prompts; returns ``params.n`` completions per prompt, in order."""
        ...


class RunStopped(Exception):
    """Raised by ``collect`` when ``request_stop`` was called while it waited: the run ends without the step."""


class Weights(Protocol):
    """The learner's live weights as a snapshot source (what ``RolloutSource.on_version`` is handed)."""

    dtype: str  # the snapshot's dtype, e.g. "bfloat16": what the workers will serve
    local: bool  # True: this process can write the snapshot alone; False: sharded, every learner rank joins write()

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Called before each publish (by every learner rank when sharded): the policy's logprobs of fixed tokens."""
        ...

    def write(self, path: str | None) -> None:
        """Called once per publish: stream the snapshot (safetensors) into ``path`` (None: another rank writes)."""
        ...


class RolloutSource(Protocol):
    """Where the learner's batches come from.

    ``needs_policy`` tells the learner whether to lend its live (unwrapped, gathered) model to ``collect``:
    True for on-policy sources that generate in the learner's process, False for remote ones.
    """

    needs_policy: bool
    max_staleness: int | None
    """The largest ``rollout.staleness`` the source supports (None: any); config validation reads it."""

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        """Called once per learner step, before the loss, with the step's prompt rows (one per group) and the
        current policy version; returns scored groups, one per row, each with lag ``version - group.version``
        within the source's staleness bound."""
        ...

    def on_version(self, version: int, weights: Weights) -> None:
        """Called after every optimizer step with the new version and the live weights (the place to publish a
        snapshot)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Called once per step after ``collect``; namespaced counters the source wants logged."""
        ...

    def checkpoint(self) -> dict[str, Any]:
        """Called when the learner saves a checkpoint (between steps); JSON-able state to resume the source from,
        handed back to the source's constructor as ``resume``."""
        ...

    def on_resume(self, version: int, weights: Weights) -> None:
        """Called once when a resumed learner starts, with its restored version and weights."""
        ...

    def request_stop(self) -> None:
        """Called from a signal handler (SIGTERM, Ctrl-C): a ``collect`` that waits raises RunStopped soon."""
        ...

    def close(self) -> dict[str, Any]:
        """Called once at the end of training, also on failure. Returns the rollout accounting: ``dispatched``,
        ``received``, ``consumed``, ``dropped`` and ``lost`` (reason -> count), ``in_flight``; they add up."""
        ...
