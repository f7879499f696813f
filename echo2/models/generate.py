"""The transformers engine: ``model.generate`` with behaviour logprobs, for machines without vLLM and tests.

Logprobs are read from the *processed* scores, i.e. the distribution the token was actually drawn from, the
same convention as vLLM's ``processed_logprobs``. Sampling is the full softmax at temperature T, so they equal
``log_softmax(logits / T)``, exactly what the learner recomputes, and on-policy ratios are 1. That takes care:
``generate`` fills every knob left unset from the model's ``generation_config.json`` (Qwen3 ships top_k 20,
top_p 0.95; a list-valued one such as ``suppress_tokens`` cannot even be set to "off" from outside), then from the
library's defaults (top_k 50). So the model's generation config is set aside while generating, and top-k and
top-p are turned off explicitly (``FULL_SOFTMAX``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig

from echo2.records import Completion, SamplingParams

# The library's defaults for what neither we nor (set aside) the model's generation config state are neutral,
# except top_k (50): every knob that could truncate is stated here as off.
FULL_SOFTMAX = dict(top_k=0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)


@contextmanager
def own_generation_config(model: Any):
    """Set the model's generation config aside (a neutral one) while ``generate`` runs: see the module doc."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class HFEngine:
    def __init__(self, pad_token_id: int, eos_token_ids: Sequence[int]):
        self.pad_token_id = pad_token_id
        self.eos_token_ids = set(eos_token_ids)

    @torch.no_grad()
    def generate(
        self, policy: Any, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, greedy: bool = False
    ) -> list[list[Completion]]:
        if params.top_p < 1 or params.top_k > 0:
            raise ValueError(f"top_p={params.top_p}, top_k={params.top_k}: truncated sampling would bias every "
                             "importance ratio (the learner scores the full softmax); use top_p=1, top_k=0")
        device = next(policy.parameters()).device
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        n = 1 if greedy else params.n
        stop = self.eos_token_ids | set(params.stop_token_ids)
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=params.temperature if not greedy else 1.0,
            **({} if greedy else FULL_SOFTMAX),  # greedy decoding applies no sampling knob
            max_new_tokens=params.max_tokens,
            num_return_sequences=n,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(stop),
            output_scores=True,
            return_dict_in_generate=True,
        )
        with own_generation_config(policy):
            out = policy.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_cfg
            )
        new_tokens = out.sequences[:, width:].cpu()
        # scores: one (B*n, V) tensor per generated position, already temperature/top-k/top-p processed.
        logps = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()
        token_logps = logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions: list[list[Completion]] = []
        for i in range(len(prompt_ids)):
            group = []
            for j in range(n):
                row = i * n + j
                ids = new_tokens[row].tolist()
                cut = next((k + 1 for k, t in enumerate(ids) if t in stop), None)
                finish = "stop" if cut is not None else "length"
                cut = cut if cut is not None else len(ids)
                group.append(Completion(ids[:cut], token_logps[row, :cut].tolist(), finish))
            completions.append(group)
        return completions
