"""Metric names and the one place they are written from: ``metrics.jsonl`` in the run dir, and the run's trackers
(``run.report_to``: wandb, tensorboard, trackio; echo2/trackers.py).

Every key is namespaced (``train/ reward/ rollout/ buffer/ broadcast/ activation/ cost/ eval/``). TRL's own
log keys (``loss``, ``grad_norm``, ``clip_ratio/...``) are moved under ``train/``; ``TRL_NAMES`` maps echo2's keys to
the names TRL's GRPOTrainer logs the same quantities under. Only rank 0 writes; the same calls work with every
tracker off (``run.report_to=none``).

Every key the library writes or reads is a constant below, one per key, grouped by namespace; a key made per
worker, credential or reward function is a prefix constant (``..._PREFIX``, ending in ``/``) the caller appends
the name to. The strings are what ``metrics.jsonl``, wandb dashboards, BENCHMARKS.md and the tests read: change
one and they no longer find it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------- train/
# The learner's step (echo2/learner/); TRL's own keys come in through ``namespaced`` below.
TRAIN_LR = "train/lr"  # learning rate of the step (TRL's ``learning_rate``)
TRAIN_STEP_TIME_S = "train/step_time_s"  # time in the step's ``training_step`` calls, s (TRL's ``step_time``)
TRAIN_GRAD_NORM = "train/grad_norm"  # gradient norm of the step, before clipping (TRL's ``grad_norm``)
TRAIN_LEARNER_IDLE_S = "train/learner_idle_s"  # time the step spent obtaining its rollouts, s
TRAIN_LEARNER_UTILIZATION = "train/learner_utilization"  # 1 - idle / wall since the first batch, 0 to 1
TRAIN_PUBLISH_S = "train/publish_s"  # time the previous step spent publishing its snapshot (rank 0), s
TRAIN_LR_STALENESS_FACTOR = "train/lr_staleness_factor"  # factor the step's rate was scaled by (0 to 1)
TRAIN_SKIPPED_STEPS = "train/skipped_steps"  # steps whose loss or gradient was not finite: not applied, cumulative

# --------------------------------------------------------------------------------------------------- reward/
# Over every rollout of the step's batch (all processes).
REWARD_MEAN = "reward/mean"  # mean reward (the weighted sum of the task's rewards)
REWARD_STD = "reward/std"  # standard deviation of that reward
REWARD_FRAC_ZERO_STD_GROUPS = "reward/frac_zero_std_groups"  # share of groups whose G rewards are all equal
REWARD_FUNCTION_PREFIX = "reward/"  # + a reward function's name: the mean of that function's reward
REWARD_ERRORS_PREFIX = "reward/errors/"  # + a reward function's name: the step's groups on which it failed (abstained)
# A reward function's own log_metric(name, value): the step's mean under train/<name>, as TRL's trainer logs it
# (the learner adds it to TRL's metrics by its name; ``namespaced`` files it under train/).

# -------------------------------------------------------------------------------------------------- rollout/
# Counts are cumulative over the run, in rollouts (G per group) where they count rollouts.
ROLLOUT_DISPATCHED = "rollout/dispatched"  # rollouts handed to workers
ROLLOUT_RECEIVED = "rollout/received"  # rollouts received from workers (sync source: generated)
ROLLOUT_CONSUMED = "rollout/consumed"  # rollouts the learner trained on (the learner's own count)
ROLLOUT_DROPPED = "rollout/dropped"  # rollouts dropped, every reason (stale, invalid, untrusted, ...)
ROLLOUT_DROPPED_UNTRUSTED = "rollout/dropped_untrusted"  # rollouts dropped by the rollout checks
ROLLOUT_LOST = "rollout/lost"  # rollouts lost, every reason (worker dead, deadline, restarts, ...)
ROLLOUT_LOST_DEADLINE = "rollout/lost_deadline"  # rollouts lost past their deadline
ROLLOUT_REFUSED_RESULTS = "rollout/refused_results"  # results refused at a push (late, duplicate, not in flight)
ROLLOUT_REJECTED_REQUESTS = "rollout/rejected_requests"  # HTTP requests and connections the coordinator refused
ROLLOUT_WORKERS = "rollout/workers"  # workers registered now
ROLLOUT_BENCHED_WORKERS = "rollout/benched_workers"  # workers registered now that get no more work (strikes)
ROLLOUT_FLAGGED_WORKERS = "rollout/flagged_workers"  # credentials (not worker ids) the rollout checks flagged
ROLLOUT_DEADLINE_MISSES = "rollout/deadline_misses"  # misses for groups past their deadline (per credential, per check)
ROLLOUT_INVALID_STRIKES = "rollout/invalid_strikes"  # misses for invalid pushes
ROLLOUT_REAPER_ERRORS = "rollout/reaper_errors"  # errors in the coordinator's reaper loop
ROLLOUT_JOURNAL_ERRORS = "rollout/journal_errors"  # failed writes to the rollout journal
ROLLOUT_REVOCATIONS_UNWRITTEN = "rollout/revocations_unwritten"  # revocations in effect not written down (disk full)
# journal lines a recovery skipped (past its checkpoint's fsynced part, not whole: a machine crash), cumulative
ROLLOUT_JOURNAL_DAMAGED_LINES = "rollout/journal_damaged_lines"
ROLLOUT_REWARD_PROCESS_RESTARTS = "rollout/reward_process_restarts"  # reward processes replaced
ROLLOUT_COORDINATOR_RESTARTS = "rollout/coordinator_restarts"  # coordinator processes restarted by the learner
ROLLOUT_GENERATE_S = "rollout/generate_s"  # sync source: time the step spent generating, s
ROLLOUT_COMPLETION_LEN_MEAN = "rollout/completion_len_mean"  # mean completion length in the step's batch, tokens
# (the model's tokens only: a multi-turn episode's environment tokens are not counted, as TRL counts them)
# A multi-turn task's episodes (echo2/tasks/environments/), over the step's batch:
ROLLOUT_TURNS_MEAN = "rollout/turns_mean"  # model turns per episode
ROLLOUT_TOOL_CALLS_MEAN = "rollout/tool_calls_mean"  # tool calls per episode
ROLLOUT_TOOL_ERRORS = "rollout/tool_errors"  # tool calls answered with an error (unknown tool, the tool raised)
ROLLOUT_ENV_REWARD_MEAN = "rollout/env_reward_mean"  # the environment's own reward (get_reward, SkyRL step rewards)
ROLLOUT_ENV_ERRORS = "rollout/env_errors"  # episodes ended by an environment that raised or overran its time limit
ROLLOUT_ENV_TOKENS_FRAC = "rollout/env_tokens_frac"  # share of the completions' tokens that are the environment's
ROLLOUT_ENVIRONMENT_PREFIX = "rollout/environment/"  # + a name: the step's mean of what the environments' own
#                                                    get_metrics() reported under it (SkyRL's, averaged as SkyRL does)
ROLLOUT_COMPLETION_LEN_MIN = "rollout/completion_len_min"  # shortest completion in the step's batch, tokens
ROLLOUT_COMPLETION_LEN_MAX = "rollout/completion_len_max"  # longest completion in the step's batch, tokens
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"  # share of the batch's completions cut at max_completion_length
ROLLOUT_TOKENS = "rollout/tokens"  # prompt + completion tokens of the step's batch (all processes)
ROLLOUT_TOKENS_TOTAL = "rollout/tokens_total"  # prompt + completion tokens trained on so far (TRL's num_tokens)
ROLLOUT_THROUGHPUT_PREFIX = "rollout/throughput/"  # + a worker id: its measured rate, rollouts/s
ROLLOUT_CHECK_LOG_RATIO_PREFIX = "rollout/check_log_ratio/"  # + a credential: mean log-ratio so far, nats/token
ROLLOUT_CHECK_ABS_LOG_RATIO_PREFIX = "rollout/check_abs_log_ratio/"  # + a credential: mean |log-ratio|, nats/token
# The off-policy correction (``rollout.correction``), per step over the batch's real tokens; w = π_prox / π_behaviour.
ROLLOUT_IS_RATIO_MEAN = "rollout/is_ratio_mean"  # mean raw importance ratio w
ROLLOUT_IS_RATIO_MAX = "rollout/is_ratio_max"  # largest raw importance ratio w
ROLLOUT_IS_LOG_RATIO_M2 = "rollout/is_log_ratio_m2"  # second moment of log w (M2PO's M2)
ROLLOUT_IS_LOG_RATIO_M2_KEPT = "rollout/is_log_ratio_m2_kept"  # second moment of log w over the tokens kept
ROLLOUT_IS_WEIGHT_MEAN = "rollout/is_weight_mean"  # mean weight after the correction
ROLLOUT_IS_FRAC_MASKED = "rollout/is_frac_masked"  # share of tokens dropped (weight 0)
ROLLOUT_IS_FRAC_TRUNCATED = "rollout/is_frac_truncated"  # share of tokens given a lower, non-zero weight
ROLLOUT_IS_FRAC_CORRECTED = "rollout/is_frac_corrected"  # share of tokens dropped or truncated
# Behaviour logprobs more than rollout.max_log_ratio nats from the learner's (or NaN): clamped, tokens, cumulative
ROLLOUT_BOUNDED_TOKENS = "rollout/bounded_tokens"

# --------------------------------------------------------------------------------------------------- buffer/
BUFFER_GROUPS = "buffer/groups"  # groups scored and waiting for the learner, now
BUFFER_IN_FLIGHT_GROUPS = "buffer/in_flight_groups"  # groups out at workers, now
BUFFER_DROPPED_STALE = "buffer/dropped_stale"  # rollouts dropped as too stale to train on, cumulative
BUFFER_STALENESS_MEAN = "buffer/staleness_mean"  # mean policy lag of the step's batch, versions
BUFFER_STALENESS_MAX = "buffer/staleness_max"  # largest policy lag in the step's batch, versions

# ------------------------------------------------------------------------------------------------ broadcast/
# The coordinator's broadcaster (echo2/coordinator/broadcaster.py); "round": one version sent to the peers.
BROADCAST_TIME_S = "broadcast/time_s"  # the last round, from publish to its close, s
BROADCAST_BYTES = "broadcast/bytes"  # bytes of the last round's largest order (full snapshot or delta)
BROADCAST_PREPARE_S = "broadcast/prepare_s"  # time to digest, sign and delta-encode the last snapshot, s
BROADCAST_PROBE_S = "broadcast/probe_s"  # the last version's probe, computed beside the coordinator (prober.py), s
BROADCAST_PROBE_FAILURES = "broadcast/probe_failures"  # versions not published: their probe failed, cumulative
BROADCAST_DELTA_RATIO = "broadcast/delta_ratio"  # size of the last delta / the full snapshot (1: no delta)
BROADCAST_STRIPES = "broadcast/stripes"  # stripes of the last round's layout (1: not striped)
BROADCAST_ROUNDS = "broadcast/rounds"  # rounds run, cumulative
BROADCAST_FAILURES = "broadcast/failures"  # orders peers failed (an error, or no proof they hold it), cumulative
BROADCAST_LATE = "broadcast/late"  # peers a round closed without (past their deadline), cumulative
BROADCAST_ORIGIN_BYTES = "broadcast/origin_bytes"  # bytes the origin (the coordinator's relay) served, cumulative
BROADCAST_REFUSED = "broadcast/refused"  # requests and connections the origin's relay refused, cumulative

# ----------------------------------------------------------------------------------------------- activation/
ACTIVATION_ACTIVE_WORKERS = "activation/active_workers"  # workers the plan has working
ACTIVATION_REPLANS = "activation/replans"  # plans made, cumulative
ACTIVATION_OPTIMALITY_GAP = "activation/optimality_gap"  # plan's cost / its proven lower bound - 1 (0: exact)

# ----------------------------------------------------------------------------------------------------- cost/
COST_USD = "cost/usd"  # dollars spent on the learner and active workers so far
COST_USD_PER_STEP = "cost/usd_per_step"  # dollars of the last learner step
COST_USD_PER_HOUR = "cost/usd_per_hour"  # dollars per hour of the learner and active workers now

# ----------------------------------------------------------------------------------------------------- eval/
EVAL_ACCURACY = "eval/accuracy"  # held-out (greedy) accuracy, 0 to 1
EVAL_EXAMPLES = "eval/examples"  # held-out examples evaluated
EVAL_REWARD_MEAN = "eval/reward_mean"  # a multi-turn task's eval reward over held-out episodes (poker: chips won)
# run.eval_on=workers: the policy version a worker evaluated (the record's step is when its result came back), and
# held-out rows whose judging failed (timed out, raised) and so count as not correct
EVAL_VERSION = "eval/version"
EVAL_UNSCORED = "eval/unscored"
# seconds the evaluation took: on the learner, the time its steps waited; on a worker, from handing the rows out to
# judging them (the learner does not wait)
EVAL_TIME_S = "eval/time_s"

# TRL's GRPOTrainer logs the same quantities under these names (its wandb panels show them under ``train/``):
# echo2 logs each once, under its own key (docs/logging.md has this table). A reward function's mean,
# TRL's ``rewards/<name>/mean``, is echo2's ``reward/<name>``.
TRL_NAMES = {
    REWARD_MEAN: "reward",
    REWARD_STD: "reward_std",
    REWARD_FRAC_ZERO_STD_GROUPS: "frac_reward_zero_std",
    ROLLOUT_COMPLETION_LEN_MEAN: "completions/mean_length",
    ROLLOUT_COMPLETION_LEN_MIN: "completions/min_length",
    ROLLOUT_COMPLETION_LEN_MAX: "completions/max_length",
    ROLLOUT_TRUNCATED_FRAC: "completions/clipped_ratio",
    ROLLOUT_TOKENS_TOTAL: "num_tokens",
    TRAIN_LR: "learning_rate",
    TRAIN_GRAD_NORM: "grad_norm",
    TRAIN_STEP_TIME_S: "step_time",
    "train/loss": "loss",
    "train/kl": "kl",
    "train/entropy": "entropy",
    "train/clip_ratio/region_mean": "clip_ratio/region_mean",
    "train/clip_ratio/low_mean": "clip_ratio/low_mean",
    "train/clip_ratio/high_mean": "clip_ratio/high_mean",
}

NAMESPACES = ("train/", "reward/", "rollout/", "buffer/", "broadcast/", "activation/", "cost/", "eval/")
# TRL log keys with an obvious better name; the rest go under train/ as they are.
_RENAME = {"step_time": TRAIN_STEP_TIME_S, "learning_rate": TRAIN_LR, "epoch": None, "total_flos": None}


def namespaced(logs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in logs.items():
        if key in _RENAME:
            if _RENAME[key]:
                out[_RENAME[key]] = value
        elif key.startswith(NAMESPACES):
            out[key] = value
        else:
            out["train/" + key.removeprefix("train_")] = value
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsSink:
    """Writes one JSON object per learner step to ``metrics.jsonl`` and mirrors it to the run's trackers
    (``run.report_to``: wandb, tensorboard, trackio; echo2/trackers.py)."""

    def __init__(self, run_dir: str | Path, wandb_mode: str = "offline", project: str = "echo2",
                 group: str | None = None, name: str | None = None, config: dict | None = None,
                 resume_step: int | None = None, report_to: Any = ("wandb",), tags: list[str] = ()):
        """``resume_step``: a run resumed from the checkpoint at that step: records after it (written by steps
        that were thrown away) are cut from ``metrics.jsonl``, ``consumed.jsonl`` and ``completions.jsonl``, and the
        trackers continue the same run. ``report_to``: as TRL's (a name, a list, ``all`` or ``none``)."""
        from echo2.trackers import open_trackers, resolve_report_to

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.consumed_path = self.run_dir / "consumed.jsonl"
        self.completions_path = self.run_dir / "completions.jsonl"
        self.previous: list[dict] = []  # records kept from before a resume
        if resume_step is not None:
            self.previous = _truncate(self.path, resume_step)
            _truncate(self.consumed_path, resume_step)
            _truncate(self.completions_path, resume_step)
        else:  # a fresh run in a used directory starts its logs afresh
            for p in (self.path, self.consumed_path, self.completions_path):
                p.unlink(missing_ok=True)
        self._file = self.path.open("a")
        self._consumed = self.consumed_path.open("a")
        self._completions = self.completions_path.open("a")
        self.trackers = open_trackers(resolve_report_to(report_to), self.run_dir, wandb_mode, project, group, name,
                                      config, list(tags), resume_step)
        wandb = [t for t in self.trackers if type(t).__name__ == "WandbTracker"]
        self.wandb_info: dict[str, Any] | None = wandb[0].info if wandb else None  # as wandb has it
        self.tracker_info = {type(t).__name__.removesuffix("Tracker").lower(): t.info for t in self.trackers}

    def log(self, record: dict[str, Any]) -> None:
        record = {k: _json_safe(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(record, int(record["step"]))

    def consumed(self, step: int, groups: list[Any]) -> None:
        """One line per learner step: the groups it trained on (ids, training-set rows, policy versions)."""
        self._consumed.write(json.dumps({"step": step, "groups": [g.group_id for g in groups],
                                         "rows": [g.row_index for g in groups],
                                         "versions": [g.version for g in groups]}) + "\n")
        self._consumed.flush()

    def completions(self, step: int, columns: list[str], rows: list[list]) -> None:
        """The sample-completions table of a step: one line per row in ``completions.jsonl`` (with its step), and a
        table named ``completions`` in each tracker."""
        for row in rows:
            self._completions.write(json.dumps({"step": step, **dict(zip(columns, map(_json_safe, row)))}) + "\n")
        self._completions.flush()
        for tracker in self.trackers:
            tracker.table("completions", columns, rows, step)

    def summary(self, summary: dict[str, Any]) -> None:
        summary = {**{k: _json_safe(v) for k, v in summary.items()}, "wandb": self.wandb_info,
                   "trackers": self.tracker_info}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        for tracker in self.trackers:
            tracker.summary(summary)

    def close(self) -> None:
        self._file.close()
        self._consumed.close()
        self._completions.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _truncate(path: Path, step: int) -> list[dict]:
    """Keep the records of ``path`` (JSON lines with a ``step``) up to ``step``; returns them."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line of a killed run
            continue
        if record.get("step", 0) <= step:
            kept.append(record)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return kept
