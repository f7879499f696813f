"""A worker's own transformers model behind the worker-engine interface: for hosts without vLLM, and tests.

A LoRA policy's snapshot (only the adapter, echo2/broadcast/adapter.py) is merged into the adapted layers'
weights, each time from a copy of the base weights taken before the first adapter: W = W_base + (alpha/r) B A.
"""

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
        self.base: dict[str, torch.Tensor] = {}  # the adapted layers' base weights, kept from the first adapter on

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(self.model, prompt_ids, params)

    def load_weights(self, version: int, blob) -> dict:
        from echo2.broadcast.adapter import spec_of
        from echo2.broadcast.snapshot import decode, metadata

        spec = spec_of(metadata(blob))
        if spec is not None:
            return self._merge(version, spec, decode(blob))
        self.base.clear()  # a full snapshot: any kept base weights are no longer what the model holds
        missing, unexpected = self.model.load_state_dict(decode(blob), strict=False)
        # A tied weight is stored once (snapshot.save, encode); its other name shares the loaded tensor here.
        tied = {name for name, p in self.model.named_parameters(remove_duplicate=False)
                if any(p is q for n, q in self.model.named_parameters() if n != name)}
        if unexpected or [m for m in missing if "rotary" not in m and m not in tied]:
            raise ValueError(f"snapshot v{version} does not fit the model: missing {missing}, unexpected {unexpected}")
        return {}

    @torch.no_grad()
    def _merge(self, version: int, spec, tensors: dict) -> dict:
        from echo2.broadcast.adapter import pairs

        modules = dict(self.model.named_modules())
        merged = 0
        for name, (lora_a, lora_b) in pairs(tensors).items():
            module = modules.get(name)
            if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise ValueError(f"adapter v{version} targets {name!r}, which this model does not have: is this "
                                 "worker's model the learner's base model?")
            base = self.base.setdefault(name, module.weight.detach().clone())
            module.weight.copy_(spec.merged(base, lora_a, lora_b))
            merged += 1
        return {"merged_modules": merged}

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return probe_logprobs(self.model, token_ids)

    def close(self) -> None:
        pass
