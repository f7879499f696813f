"""What a worker may send in a pushed result: the checks every result passes, or a BadRequest that names what is
wrong (the rest of each request body is checked by schemas.py). A worker is not trusted; nothing it sends is
scored or counted before these pass. One bad result costs its own group (dropped: invalid), not the push.

    push result ──parse_result──► [Rollout] × G   (token ids inside the vocabulary, 1..max_tokens of them, one
                                                   logprob each, finite and <= 0, a known finish reason)

Rewards are never taken from a worker (the coordinator scores with the task's own functions), and a version
from the future, or one the worker was never delivered, is refused when the group is settled (intake.py).
"""

from __future__ import annotations

import math

from echo2.records import Completion, Rollout
from echo2.net.http import BadRequest


def parse_result(res: dict, prompt_ids: list[int], group_size: int, max_tokens: int,
                 vocab_size: int) -> list[Rollout]:
    """The ``group_size`` rollouts of one pushed result for the prompt ``prompt_ids``."""
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
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4 for x in lps):
            raise BadRequest("logprobs must be finite and <= 0")
        finish = c.get("finish_reason")
        if finish not in ("stop", "length"):
            raise BadRequest(f"finish_reason {finish!r}")
        comp = Completion(ids, [float(x) for x in lps], finish)
        rollouts.append(Rollout(prompt_ids=prompt_ids, completion=comp, version=version))
    return rollouts


def integer(body: dict, key: str, lo: int, hi: int) -> int:
    """``body[key]``, an int in [lo, hi] (not a bool, not a float)."""
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value
