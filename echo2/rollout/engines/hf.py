"""The transformers engine: ``model.generate`` with behaviour logprobs, for machines without vLLM and tests.

Logprobs are read from the *processed* scores (after temperature, top-k, top-p), i.e. the distribution the
token was actually drawn from, the same convention as vLLM's ``processed_logprobs``. With top-k and top-p
off they equal ``log_softmax(logits / T)``, exactly what the learner recomputes, so on-policy ratios are 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from echo2.rollout.types import Completion, SamplingParams


class HFEngine:
    def __init__(self, pad_token_id: int, eos_token_ids: Sequence[int]):
        self.pad_token_id = pad_token_id
        self.eos_token_ids = set(eos_token_ids)

    @torch.no_grad()
    def generate(
        self, policy: Any, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, greedy: bool = False
    ) -> list[list[Completion]]:
        device = next(policy.parameters()).device
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        n = 1 if greedy else params.n
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=params.temperature if not greedy else None,
            top_p=params.top_p if not greedy else None,
            top_k=(params.top_k or None) if not greedy else None,
            max_new_tokens=params.max_tokens,
            num_return_sequences=n,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_token_ids),
            output_scores=True,
            return_dict_in_generate=True,
        )
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
                cut = next((k + 1 for k, t in enumerate(ids) if t in self.eos_token_ids), None)
                finish = "stop" if cut is not None else "length"
                cut = cut if cut is not None else len(ids)
                group.append(Completion(ids[:cut], token_logps[row, :cut].tolist(), finish))
            completions.append(group)
        return completions


class HFWorkerEngine:
    """A worker's own transformers model behind the worker-engine interface (no vLLM needed)."""

    name = "hf"

    def __init__(self, model_path: str, dtype: str = "float32", pad_token_id: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, **_ignored):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        tok = AutoTokenizer.from_pretrained(model_path)
        self.engine = HFEngine(tok.pad_token_id if pad_token_id is None else pad_token_id,
                               eos_token_ids or [tok.eos_token_id])

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(self.model, prompt_ids, params)

    def load_weights(self, version: int, blob: bytes) -> None:
        from echo2.broadcast.snapshot import decode

        missing, unexpected = self.model.load_state_dict(decode(blob), strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise ValueError(f"snapshot v{version} does not fit the model: missing {missing}, unexpected {unexpected}")

    def close(self) -> None:
        pass
