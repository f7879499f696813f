"""Settings that cross from the learner's process into the coordinator's: frozen, checked where they are built.

The learner builds one CoordinatorSettings from its config (``rollout.*``, ``broadcast.*``, ``activation.*``; a bad
value fails there, before any process starts) and hands it whole to the coordinator process, which builds its
parts from it. The meaning of each liveness and check value is in echo2/coordinator/liveness.py and trust.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from echo2.activation.settings import ActivationSettings, BroadcastShape


@dataclass(frozen=True)
class LivenessSettings:
    floor_s: float = 10.0  # no deadline shorter than this (network round trips, a slow first token)
    cap_s: float = 600.0  # no deadline longer than this; also every deadline while no worker has a measured rate
    slack: float = 4.0  # multiple of the expected generation time a worker is given
    share: float = 0.5  # most of the in-flight cap one principal may hold (while > 1/share can get work), in (0, 1]
    strikes: int = 3  # misses after which a principal gets no more work

    def __post_init__(self):
        if not 0 < self.floor_s <= self.cap_s:
            raise ValueError(f"deadline floor_s={self.floor_s}, cap_s={self.cap_s}: need 0 < floor_s <= cap_s")
        if not self.slack >= 1:
            raise ValueError(f"deadline slack={self.slack}: need >= 1")
        if not 0 < self.share <= 1:
            raise ValueError(f"worker share={self.share}: need 0 < share <= 1")
        if self.strikes < 1:
            raise ValueError(f"deadline strikes={self.strikes}: need >= 1")


@dataclass(frozen=True)
class CheckSettings:
    """The rollout checks' thresholds (echo2/coordinator/trust.py)."""

    # b: mean |log-ratio| per token an honest worker stays under, in nats. Scored under the version it claims
    # (echo2/learner/past_policies.py) an honest worker is off by the engines' numerics only (0 for the hf engine,
    # ~1e-2 in half precision); forged tokens sit 3-10 nats out. 2 also covers ZeRO-3, which keeps no past versions:
    # there one large step of the tiny model (learning rate 3e-3) moved lagged tokens by ~1.1 nats each, and at b = 1
    # a soak retired its only honest worker.
    max_abs_log_ratio: float = 2.0
    # E: CUSUM of excess nats at which a principal is retired (E/4: flagged). 12: the demo task's fabricated answer
    # (16 tokens a group at ~3 nats) is one group's evidence at b = 2 (at 24 it needed two groups in checked batches,
    # and a forger holding one group at a time slipped through a 30-step run checked every 10th batch)
    evidence_nats: float = 12.0

    def __post_init__(self):
        if not self.max_abs_log_ratio > 0 or not self.evidence_nats > 0:
            raise ValueError(f"rollout checks: max_abs_log_ratio={self.max_abs_log_ratio} and evidence_nats="
                             f"{self.evidence_nats} must be > 0")


@dataclass(frozen=True)
class CoordinatorSettings:
    """What the coordinator process runs with (echo2/coordinator/coordinator.py reads each), but the task and
    tokenizer (objects the learner hands over beside it)."""

    token: str  # the run secret: workers authenticate with it or a credential derived from it
    staleness: int  # S: the most versions a consumed group may lag the learner
    prompts_per_step: int  # P: groups per batch (one batch per learner step, or per steps_per_batch steps)
    group_size: int  # G: completions per prompt
    sampling: dict[str, Any]  # what workers sample with (max_tokens, temperature, top_p, top_k, stop_token_ids)
    vocab_size: int  # a pushed token id must be below it
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_timeout_s: float = 30.0
    groups_per_pull: int = 4
    long_poll_s: float = 2.0  # a pull with nothing to hand out waits up to this long (at most heartbeat/4)
    seed: int = 0  # the prompt order
    activation: ActivationSettings = field(default_factory=ActivationSettings)
    broadcast_shape: BroadcastShape = field(default_factory=BroadcastShape)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)
    checks: CheckSettings = field(default_factory=CheckSettings)
    journal: str | None = None  # the ledger's journal file (None: none)
    recover: dict | None = None  # {"restart": True} after a coordinator died; {"resume_offset": N} on a resume
    version: int = 0  # the learner's version when this coordinator starts
    tls_dir: str | None = None  # the run CA's directory: set, every server of the rollout plane speaks TLS
    epoch: str | None = None  # names the learner process (a resumed learner is a new epoch)
    requires: dict | None = None  # what a worker must serve: {"model": identity, "max_model_len": tokens}
    broadcaster: dict | None = None  # the broadcast.sender config (its _target_ and options), built in the process
    reward_processes: int = 2  # the reward pool's processes, each group scored within reward_timeout_s
    reward_timeout_s: float = 10.0
    max_steps: int = 0  # the run's learner steps (run.steps): what reward functions read as trainer_state.max_steps
    episode: dict | None = None  # a multi-turn task's EpisodeSpec (as_dict): sent to workers, who run the episodes
    # what scoring may add to a reward process's address space on top of what loading the task took, MiB (0: no limit)
    reward_memory_mb: int = 2048
    # CPU seconds one group's scoring may use in a reward process (RLIMIT_CPU, re-armed per group; 0: no limit)
    reward_cpu_s: float = 30.0
    # At a learner checkpoint the journal is rewritten without what precedes the oldest kept checkpoint, once that is
    # this many MiB (0: at every checkpoint): rarely enough that the copy of what is kept (under the coordinator's
    # lock; tens of ms for tens of MiB) costs no step anything, small enough that a long run's journal stays near it
    # plus what its kept checkpoints span. None: never.
    journal_compact_mb: float | None = 64.0

    steps_per_batch: int = 1  # μ (learner.num_iterations): the learner takes a batch every μ versions
    evaluate: bool = False  # run.eval_on=workers: run-secret workers evaluate the task's held-out rows
    # the learner's model directory, for probes computed beside the coordinator (coordinator/prober.py); None: the
    # learner computes every probe itself (rollout.source.probe_on=learner)
    probe_model: str | None = None

    def __post_init__(self):
        if self.steps_per_batch < 1:
            raise ValueError(f"learner.num_iterations={self.steps_per_batch}: must be >= 1")
        from echo2.credential import check_run_secret
        from echo2.net.tls import is_loopback

        if self.reward_processes < 1 or not self.reward_timeout_s > 0:
            raise ValueError(f"rollout.source.reward_processes={self.reward_processes} must be >= 1 and "
                             f"reward_timeout_s={self.reward_timeout_s} > 0")
        if self.reward_memory_mb < 0 or self.reward_cpu_s < 0:
            raise ValueError(f"reward_memory_mb={self.reward_memory_mb} and reward_cpu_s={self.reward_cpu_s}: "
                             "must be >= 0 (0: no limit)")
        check_run_secret(self.token, exposed=not is_loopback(str(self.host)))

    def items(self) -> dict[str, Any]:
        """Field by field (nested settings stay objects, unlike dataclasses.asdict)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
