"""The probe: a worker's check that it serves the version it claims.

The learner computes the policy's logprobs of a fixed, seeded draw of tokens (``probe_tokens``) and signs them into
every snapshot's manifest; a worker's engine computes the same after applying the snapshot, and claims the version
only where they agree (within the snapshot dtype's tolerance). Both sides use ``probe_logprobs`` for a transformers
model; vLLM workers compute theirs inside the engine (echo2/worker/engines/vllm_ext.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


def probe_tokens(vocab_size: int, n: int = 33) -> list[int]:
    """The fixed tokens whose logprobs check a worker's weights: a seeded draw over the whole vocabulary, so that
    every row of the embedding and of the LM head can show up (a stale tied head did, by ~1 nat)."""
    rng = random.Random(0)
    return [rng.randrange(vocab_size) for _ in range(n)]


def probe_logprobs(model: Any, token_ids: Sequence[int]) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) at temperature 1 for i >= 1: the learner's side of a worker's check that
    it serves the version it claims (the worker computes the same with its engine after applying it)."""
    import torch  # here, not at the top: composing a config reads the async source's module, which imports this

    with torch.no_grad():
        device = next(model.parameters()).device
        ids = torch.tensor([list(token_ids)], device=device)
        logps = model(ids).logits[0, :-1].float().log_softmax(-1)
        return logps.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
