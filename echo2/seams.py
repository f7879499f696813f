"""The seams between the processes' planes: what one plane calls of another, never its implementation.

``RolloutSource``  the learner's view of where batches come from (echo2/learner/sources/); ``RemoteSource`` adds what a
                   source fed by remote workers does for a learner of several processes (echo2/learner/distributed.py)
``Weights``        the learner's live weights, as a source publishes them
``Engine``         generation in the learner's process (echo2/models/generate.py)
``Broadcaster``    weight dissemination, as the coordinator process drives it (echo2/coordinator/broadcaster.py)
``CoordinatorCalls`` what the learner asks of the coordinator process through its pipe

``RunParts``       what train.py hands every rollout source, beside the source's own options from its config

A source is built by train.py as ``Source(parts, **options)``: ``parts`` a RunParts, ``options`` its config node
(``rollout.source``), whose schema echo2/config.py reads from the constructor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from echo2.records import Completion, RolloutGroup, SamplingParams


@dataclass(frozen=True)
class RunParts:
    """The run's parts, built once by train.py; each source uses those it needs."""

    task: Any  # echo2/tasks: the dataset and reward functions
    tokenizer: Any
    scorer: Any  # scoring.Scorer: rewards for rollouts generated in the learner's process
    sampling: SamplingParams
    engine: Any  # an Engine, for sources that generate in the learner's process (and evaluation)
    model_path: str  # what workers load (its identity is checked when they register)
    run_dir: str
    seed: int
    staleness: int  # S (rollout.staleness): the most versions a consumed rollout may lag
    prompts_per_step: int  # P
    publish_interval: int  # κ (broadcast.interval): a snapshot every κ versions
    token: str  # the run secret
    broadcaster: dict | None  # the broadcast.sender config, built where the broadcaster runs
    pool: Any  # rollout/pool.py: the workers this run starts or lists
    activation: Any  # activation.settings.ActivationSettings
    broadcast_shape: Any  # activation.settings.BroadcastShape
    resume: dict | None = None  # what the source's checkpoint() returned, when the learner resumes from one
    max_steps: int = 0  # the run's learner steps (run.steps), which reward functions read in trainer_state
    steps_per_batch: int = 1  # μ (learner.num_iterations): optimizer steps (versions) the learner makes per batch
    # run.eval_on=workers: workers evaluate every this many versions and the last (run.eval_every_steps); 0: they
    # never do (the learner evaluates, or nobody)
    worker_eval_every_steps: int = 0


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
    compute_dtype: str  # the dtype the probe's activations are computed in (the weights the forward reads)
    local: bool  # True: this process can write the snapshot alone; False: sharded, every learner rank joins write()
    written: bool  # whether write() has started (its gathers are collectives: a rank that failed before joins them)
    adapter: Any  # a LoRA policy's broadcast.adapter.AdapterSpec (the snapshot holds only the adapter), or None
    base_dtype: str  # the dtype the weights the snapshot leaves out are held in (a LoRA policy's frozen base)
    device: str  # where the learner computes ("cpu", "cuda"): where a probe it computes would run

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Called before each publish (by every learner rank when sharded) where the learner computes the probe
        (``RemoteSource.learner_probe_ids``): the policy's logprobs of fixed tokens."""
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
    single_process: bool
    """True where the source works with one learner process only (config validation reads it)."""

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

    def checkpoint(self, kept: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Called when the learner saves a checkpoint (between steps); JSON-able state to resume the source from,
        handed back to the source's constructor as ``resume``. ``kept``: what it returned for the earlier
        checkpoints a resume may still use (None: all of them), so that it may forget what only older ones need."""
        ...

    def on_resume(self, version: int, weights: Weights) -> None:
        """Called once when a resumed learner starts, with its restored version and weights."""
        ...

    check_every_steps: int
    """Every how many steps the learner scores the batch's behaviour logprobs per worker and calls ``on_check``
    (0: never; sources whose rollouts the learner generated itself have nothing to check)."""

    def on_check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        """Called every ``check_every_steps`` steps with per-worker sums (tokens, log-ratio, |log-ratio|) of the
        learner's logprobs against the workers'; returns the workers whose groups in the batch must not be trained
        on."""
        ...

    def request_stop(self) -> None:
        """Called from a signal handler (SIGTERM, Ctrl-C): a ``collect`` that waits raises RunStopped soon."""
        ...

    def close(self) -> dict[str, Any]:
        """Called once at the end of training, also on failure. Returns the rollout accounting: ``dispatched``,
        ``received``, ``consumed``, ``dropped`` and ``lost`` (reason -> count), ``in_flight``; they add up."""
        ...


class RemoteSource(RolloutSource, Protocol):
    """A source fed by remote workers (echo2/learner/sources/async_source.py). With several learner processes, rank 0 alone
    holds it and echo2/learner/distributed.py splits ``on_version`` in two, since every rank must join a snapshot's
    gather: ``advance``, then, where due, the probe on every rank and ``publish``."""

    probe_ids: list[int]
    """The fixed tokens whose logprobs (``Weights.probe_logprobs``) go with every snapshot (echo2/models/probe.py)."""

    def advance(self, version: int) -> bool:
        """The first half of ``on_version``: the new version is live; returns whether a snapshot is due now."""
        ...

    def learner_probe_ids(self, weights: Weights) -> list[int] | None:
        """Before each publish: the probe tokens, where the learner computes the probe of ``weights``' snapshot;
        None where the coordinator computes it from the snapshot (``rollout.source.probe_on``)."""
        ...

    def publish(self, version: int, weights: Weights, probe: list[float] | None = None) -> None:
        """The second half: hand snapshot ``version`` to the broadcaster with its probe logprobs (computed here
        when None and the learner computes them)."""
        ...


class Broadcaster(Protocol):
    """Weight dissemination, driven by the coordinator process: ``broadcast.sender`` names the
    implementation, which that process builds from its config (echo2/coordinator/broadcaster.py)."""

    on_delivered: Any
    """Set by the coordinator: ``on_delivered(peer_id, version)`` after a worker holds a verified snapshot,
    so a worker long-polling with an old version is told at once to apply it."""

    on_ordered: Any
    """Set by the coordinator: ``on_ordered(peer_id, version)`` before a worker is told to fetch a snapshot: it may
    hold, apply and claim it before the answer proving delivery comes back: such a claim costs it no strike."""

    epoch: str | None
    """Set by the coordinator before the first publish: the learner process's epoch, signed into every manifest and
    order (a worker takes nothing of an older epoch)."""

    def publish(self, version: int, blob: bytes, probe: Any = None) -> None:
        """Called every κ learner steps with the new weights as snapshot bytes (``snapshot.encode``) and the
        learner's probe logprobs of them (for the workers' check), or a callable that computes the probe from the
        bytes (the coordinator's prober; called in the background before the manifest is signed); returns at once
        (the send runs in the background; a newer snapshot supersedes one not yet sent)."""
        ...

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None, server_name: str | None = None) -> None:
        """Called when a worker registers (its control URL and relay node address, and with TLS the name its
        certificate must carry: its credential's); a late joiner is sent the latest snapshot."""
        ...

    def remove_peer(self, peer_id: str) -> None:
        """Called when a worker leaves or is declared dead."""
        ...

    def rekey(self) -> None:
        """Called when a worker credential is revoked, after its workers were removed: from then on they can neither
        fetch from nor serve the live workers."""
        ...

    def use_tls(self, trust: Any) -> None:
        """Called by the coordinator before it starts, when the run speaks TLS (``trust``: net.tls.Trust, the run
        CA's certificates): the broadcaster's servers and its calls to workers use it."""
        ...

    def metrics(self) -> dict[str, float]:
        """``broadcast/*`` counters, read once per learner step."""
        ...

    def close(self) -> None: ...


class CoordinatorCalls(Protocol):
    """What the learner asks of the coordinator process: one message down the pipe per call, naming the method
    (echo2/learner/sources/coordinator_process.py sends it; the Coordinator, echo2/coordinator/coordinator.py, serves it in the child)."""

    def take(self, n: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """``n`` scored groups admissible at the learner's next step, oldest first; TimeoutError if they are not
        buffered within ``timeout_s``."""
        ...

    def set_version(self, version: int) -> None:
        """The learner's new version: what became too stale is dropped, dispatch judges by it."""
        ...

    def publish(self, version: int, snapshot: str | bytes, probe: dict | None = None,
                probe_dtype: str | None = None) -> None:
        """Snapshot ``version`` for the broadcaster: its bytes, or the path of the learner's memory file.
        ``probe_dtype``: the probe's logprobs are computed by the coordinator's probe process, on the learner's model
        held in that dtype."""
        ...

    def metrics(self) -> dict[str, float]:
        """The coordinator's and its broadcaster's counters, once per learner step."""
        ...

    def status(self) -> dict[str, Any]:
        """Workers, registrations, what is buffered and in flight (tools, tests, the learner's wait lines)."""
        ...

    def mark(self, keep_from: int | None = None) -> int:
        """The journal's length, fsynced: where a learner checkpoint taken now resumes from. ``keep_from``: the
        oldest kept checkpoint's mark (None: all are kept); the journal may drop what precedes it."""
        ...

    def check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        """The rollout checks' per-worker sums; the workers whose groups in the checked batch are not trained on."""
        ...

    def request_eval(self, version: int) -> None:
        """Snapshot ``version`` is published: have a worker evaluate it on the held-out rows (run.eval_on=workers)."""
        ...

    def evaluations(self) -> dict[str, Any]:
        """``{"results": [...], "wanted": [versions]}``: workers' evaluations finished since the last call, and the
        versions asked for and not yet evaluated."""
        ...

    def close(self) -> dict[str, Any]:
        """Stop serving; the rollout accounting. The coordinator process exits after answering."""
        ...
