"""What a worker may send in a pushed result: the checks every result passes, or a BadRequest that names what is
wrong (the rest of each request body is checked by schemas.py). A worker is not trusted; nothing it sends is
scored or counted before these pass. One bad result costs its own group (dropped: invalid), not the push.

    push result ──parse_result──► [Rollout] × G   (token ids inside the vocabulary, 1..max_tokens of them, one
                                                   logprob each, in [LOGPROB_FLOOR, 0], a known finish reason)

Rewards are never taken from a worker (the coordinator scores with the task's own functions), and a version
from the future, or one the worker was never delivered, is refused when the group is settled (intake.py).

A multi-turn task's completion (``episodes``) also carries a ``mask`` (1: the model's token, 0: the environment's,
whose logprob must be 0.0), the episode's record (``episode``: bounded, checked for shape here and against the
tokens when scored) and, when its environment changed the prompt, the ``prompt_ids`` it generated from.
"""

from __future__ import annotations

from typing import Any

from echo2.records import Completion, Rollout
from echo2.net.http import BadRequest


LOGPROB_FLOOR = -1e4
"""The lowest behaviour logprob a result may claim, in nats. A sampled token is never that unlikely, and the bound
keeps what a worker claims finite in the learner's float32: -1e300 passes a finiteness check and becomes -inf there,
and -inf times a mask of 0 is NaN in the rollout checks' sums."""


def parse_result(res: dict, prompt_ids: list[int], group_size: int, max_tokens: int,
                 vocab_size: int, episodes: bool = False) -> list[Rollout]:
    """The ``group_size`` rollouts of one pushed result for the prompt ``prompt_ids`` (``episodes``: a multi-turn
    task's, each with its mask and episode record)."""
    version = integer(res, "version", 0, 1 << 40)
    comps = res.get("completions")
    if not isinstance(comps, list) or len(comps) != group_size:
        raise BadRequest(f"expected {group_size} completions")
    rollouts = []
    for c in comps:
        if not isinstance(c, dict):
            raise BadRequest("a completion must be an object")
        ids, lps = c.get("token_ids"), c.get("logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or not 1 <= len(ids) <= max_tokens:
            raise BadRequest(f"token_ids/logprobs must be lists of 1..{max_tokens}")
        if len(ids) != len(lps):
            raise BadRequest("token_ids and logprobs differ in length")
        if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise BadRequest(f"token id outside the vocabulary [0, {vocab_size})")
        if not all(isinstance(x, (int, float)) and LOGPROB_FLOOR <= x <= 1e-4 for x in lps):
            raise BadRequest(f"logprobs must be in [{LOGPROB_FLOOR:g}, 0]")
        finish = c.get("finish_reason")
        if finish not in ("stop", "length"):
            raise BadRequest(f"finish_reason {finish!r}")
        if not episodes:
            comp = Completion(ids, [float(x) for x in lps], finish)
            rollouts.append(Rollout(prompt_ids=prompt_ids, completion=comp, version=version))
            continue
        mask, record, own_prompt = _episode(c, ids, lps, vocab_size)
        comp = Completion(ids, [float(x) for x in lps], finish, mask)
        rollouts.append(Rollout(prompt_ids=own_prompt or prompt_ids, completion=comp, version=version, episode=record))
    return rollouts


MAX_PROMPT_TOKENS = 1 << 20
"""The longest prompt an environment may have made (its tokens are checked against its rendering when scored)."""
MAX_RECORD_CHARS = 1 << 20
"""An episode's record as JSON: its prompt, the environment's messages, its state (a push's body is bounded too)."""
RECORD_KEYS = {"prompt", "observations", "turns", "tool_calls", "tool_errors", "reward", "error", "state", "metrics"}
MAX_EPISODE_METRICS = 32
"""An episode's own metrics (SkyRL's get_metrics): at most this many, names of at most 64 characters, numbers."""
METRIC_BOUND = 1e12
"""The largest magnitude of an episode's metric (a worker keeps only those within it: episode_metrics)."""


def bounded_number(value: Any, bound: float) -> bool:
    """An int or float (not a bool) in [-bound, bound]: compared, never converted, so that a 400-digit integer is
    refused rather than overflowing a float; NaN fails every comparison."""
    return type(value) in (int, float) and -bound <= value <= bound


def _episode(c: dict, ids: list, lps: list, vocab_size: int) -> tuple[list[int], dict, list[int] | None]:
    """A multi-turn completion's mask, episode record and own prompt ids (None: the prompt dispatched)."""
    import json

    mask = c.get("mask")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise BadRequest("mask must be a list of 0/1, one per token")
    if any(m == 0 and lp != 0 for m, lp in zip(mask, lps)):
        raise BadRequest("an environment token (mask 0) carries a logprob: it must be 0.0")
    record = c.get("episode")
    if not isinstance(record, dict) or not set(record) <= RECORD_KEYS:
        raise BadRequest(f"episode must be an object with keys among {sorted(RECORD_KEYS)}")
    for key in ("turns", "tool_calls", "tool_errors"):
        integer(record, key, 0, 1 << 20)
    reward, error = record.get("reward"), record.get("error")
    if reward is not None and not bounded_number(reward, 1e9):
        raise BadRequest("episode.reward must be null or a finite number")
    if error is not None and not (isinstance(error, str) and len(error) <= 2000):
        raise BadRequest("episode.error must be null or a string of at most 2000 characters")
    metrics = record.get("metrics", {})
    if not (isinstance(metrics, dict) and len(metrics) <= MAX_EPISODE_METRICS and all(
            isinstance(k, str) and len(k) <= 64 and bounded_number(v, METRIC_BOUND) for k, v in metrics.items())):
        raise BadRequest(f"episode.metrics must be an object of at most {MAX_EPISODE_METRICS} finite numbers, "
                         "named in at most 64 characters")
    if not any(mask) and not (error and len(ids) == 1):
        raise BadRequest("a completion without a model token stands only for an episode that failed (one token)")
    if not isinstance(record.get("state", {}), dict) or not isinstance(record.get("observations", []), list) or not \
            all(isinstance(o, list) and all(isinstance(m, dict) for m in o) for o in record.get("observations", [])):
        raise BadRequest("episode.state must be an object, episode.observations a list of message lists")
    if len(json.dumps(record)) > MAX_RECORD_CHARS:
        raise BadRequest(f"episode record longer than {MAX_RECORD_CHARS} characters")
    own = c.get("prompt_ids")
    if own is not None:
        if not isinstance(own, list) or not 1 <= len(own) <= MAX_PROMPT_TOKENS or not all(
                type(t) is int and 0 <= t < vocab_size for t in own):
            raise BadRequest(f"prompt_ids must be 1..{MAX_PROMPT_TOKENS} token ids inside the vocabulary")
        if not isinstance(record.get("prompt"), list):
            raise BadRequest("prompt_ids without the prompt (episode.prompt) they render")
    return mask, {k: record[k] for k in record}, own


def integer(body: dict, key: str, lo: int, hi: int) -> int:
    """``body[key]``, an int in [lo, hi] (not a bool, not a float)."""
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value
