"""A worker's own transformers model behind the worker-engine interface: for hosts without vLLM, and tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from echo2.models.generate import HFEngine
from echo2.models.probe import probe_logprobs
from echo2.records import Completion, SamplingParams


class HFWorkerEngine:
    """A worker's own transformers model behind the worker-engine interface (no vLLM needed)."""

    name = "hf"

    def __init__(self, model_path: str, dtype: str = "float32", pad_token_id: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, **_ignored):
        from transformers import AutoModelForCausalLM

        from echo2.models.tokenizer import load_tokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        tok = load_tokenizer(model_path)
        self.engine = HFEngine(tok.pad_token_id if pad_token_id is None else pad_token_id,
                               eos_token_ids or [tok.eos_token_id])

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(self.model, prompt_ids, params)

    def load_weights(self, version: int, blob) -> dict:
        from echo2.broadcast.snapshot import decode

        missing, unexpected = self.model.load_state_dict(decode(blob), strict=False)
        # A tied weight is stored once (snapshot.save, encode); its other name shares the loaded tensor here.
        tied = {name for name, p in self.model.named_parameters(remove_duplicate=False)
                if any(p is q for n, q in self.model.named_parameters() if n != name)}
        if unexpected or [m for m in missing if "rotary" not in m and m not in tied]:
            raise ValueError(f"snapshot v{version} does not fit the model: missing {missing}, unexpected {unexpected}")
        return {}

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return probe_logprobs(self.model, token_ids)

    def close(self) -> None:
        pass
