"""What the reward functions logged while scoring a batch, into the learner's log, as TRL's trainer logs it.

Reward functions run where rollouts are scored (the coordinator's reward processes for remote rollouts, the learner
for ``rollout=sync``); what they pass to ``log_metric`` and ``log_extra``, and the errors of those that failed, come
back with each scored group (``RolloutGroup.reward_logs``). Per learner step, over every process's groups:

* ``log_metric(name, value)``: the mean of the values logged for the step's groups, under ``name`` in the trainer's
  metrics, as TRL's ``_calculate_rewards`` flushes them; the metrics sink files it as ``train/<name>``, the key TRL
  runs show.
* ``log_extra(column, values)``: the values beside each rollout in the trainer's completions log (TRL's
  ``_logs["extra"]``, with the prompts, completions, per-function rewards and advantages it sits beside), which TRL's
  completions table prints and sends to its trackers when ``log_completions`` is on.
* errors: ``reward/errors/<function>``, the step's groups on which that function failed (it abstained there).

Every process runs this with its own groups: the names are gathered first (sorted, so every process makes the same
collective calls in the same order), as TRL does.

``log_episodes``: a multi-turn task's per-step counts (turns, tool calls and their errors, the environment's own
reward, environments that failed), over every process's groups.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from accelerate.utils import gather_object

from echo2.metrics import (REWARD_ERRORS_PREFIX, ROLLOUT_ENV_ERRORS, ROLLOUT_ENV_REWARD_MEAN, ROLLOUT_ENV_TOKENS_FRAC,
                           ROLLOUT_ENVIRONMENT_PREFIX, ROLLOUT_TOOL_CALLS_MEAN, ROLLOUT_TOOL_ERRORS,
                           ROLLOUT_TURNS_MEAN)
from echo2.records import RolloutGroup


def log_reward_logs(trainer: Any, groups: list[RolloutGroup], advantages: torch.Tensor) -> None:
    """Log what ``groups``' reward functions logged, and their completions, into ``trainer``'s metrics and logs."""
    acc, device = trainer.accelerator, trainer.accelerator.device
    logs = [g.reward_logs or {} for g in groups]
    metrics, errors = _sum_by_name(logs, "metrics"), _sum_by_name(logs, "errors")
    for name in sorted(set(gather_object(sorted(metrics)))):
        total, count = metrics.get(name, (0.0, 0))
        total, count = acc.gather(torch.tensor([[total, count]], dtype=torch.float64, device=device)).sum(0).tolist()
        if count:
            trainer._metrics["train"][name].append(total / count)
    for name in sorted(set(gather_object(sorted(errors)))):
        failed = acc.gather(torch.tensor([errors.get(name, (0, 0))[1]], device=device)).sum().item()
        trainer._metrics["train"][f"{REWARD_ERRORS_PREFIX}{name}"].append(float(failed))

    rollouts = [r for g in groups for r in g.rollouts]
    trainer._logs["prompt"].extend(gather_object([g.row.get("prompt") for g in groups for _ in g.rollouts]))
    trainer._logs["completion"].extend(gather_object([r.text for r in rollouts]))
    for name in sorted(set(gather_object(sorted({n for r in rollouts for n in r.rewards})))):
        trainer._logs["rewards"][name].extend(gather_object([r.rewards.get(name, float("nan")) for r in rollouts]))
    trainer._logs["advantages"].extend(gather_object(advantages.tolist()))
    columns = sorted(set(gather_object(sorted({c for lg in logs for c in lg.get("extra", {})}))))
    for column in columns:
        values = []
        for g, lg in zip(groups, logs, strict=True):
            got = list(lg.get("extra", {}).get(column, []))[:len(g.rollouts)]
            values += got + [None] * (len(g.rollouts) - len(got))  # a group whose functions did not log it
        trainer._logs["extra"][column].extend(gather_object(values))


def _sum_by_name(logs: list[dict], key: str) -> dict[str, tuple[float, int]]:
    """Per name: (sum, count) of the values logged (``metrics``), or (0, groups it appears in) (``errors``)."""
    out: dict[str, tuple[float, int]] = {}
    for lg in logs:
        for name, value in (lg.get(key) or {}).items():
            total, count = out.get(name, (0.0, 0))
            if key == "metrics":
                out[name] = (total + sum(value), count + len(value))
            else:
                out[name] = (total, count + 1)
    return out


ENV_METRIC_NAMES = 32  # the environments' own metrics logged a step at most (an episode reports at most 32)


def log_episodes(trainer: Any, groups: list[RolloutGroup]) -> None:
    """A multi-turn task's per-step episode metrics (echo2/metrics.py: rollout/turns_mean ...). Every process calls it
    (a collective): those without episodes in the run log nothing, and none has them unless all do (one task)."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not any(r.episode is not None for r in rollouts):
        return
    acc, device = trainer.accelerator, trainer.accelerator.device
    records = [r.episode or {} for r in rollouts]
    env_rewards = [e["reward"] for e in records if e.get("reward") is not None]
    sums = torch.tensor([[len(records), sum(e.get("turns", 0) for e in records),
                          sum(e.get("tool_calls", 0) for e in records), sum(e.get("tool_errors", 0) for e in records),
                          sum(env_rewards), len(env_rewards), sum(bool(e.get("error")) for e in records),
                          sum(len(r.completion.mask or []) - sum(r.completion.mask or []) for r in rollouts),
                          sum(len(r.completion.token_ids) for r in rollouts)]], dtype=torch.float64, device=device)
    n, turns, calls, errors, reward, rewarded, failed, env_tokens, tokens = acc.gather(sums).sum(0).tolist()
    for key, value in {ROLLOUT_TURNS_MEAN: turns / n, ROLLOUT_TOOL_CALLS_MEAN: calls / n, ROLLOUT_TOOL_ERRORS: errors,
                       ROLLOUT_ENV_REWARD_MEAN: reward / rewarded if rewarded else float("nan"),
                       ROLLOUT_ENV_ERRORS: failed, ROLLOUT_ENV_TOKENS_FRAC: env_tokens / max(tokens, 1.0)}.items():
        trainer._metrics["train"][key].append(value)
    sums, counts = Counter(), Counter()  # the environments' own metrics (SkyRL's get_metrics): a mean per name
    for name, value in gather_object([(n, v) for record in records for n, v in (record.get("metrics") or {}).items()]):
        sums[name] += value
        counts[name] += 1
    # the names most episodes report, at most ENV_METRIC_NAMES a step: a worker cannot open a thousand series
    for name in sorted(sorted(counts, key=lambda n: (-counts[n], n))[:ENV_METRIC_NAMES]):
        trainer._metrics["train"][ROLLOUT_ENVIRONMENT_PREFIX + name].append(sums[name] / counts[name])
