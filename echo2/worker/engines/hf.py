"""A worker's own transformers model behind the worker-engine interface: for hosts without vLLM, and tests.

A LoRA policy's snapshot (only the adapter, echo2/broadcast/adapter.py) is merged into the adapted layers'
weights, each time from the base checkpoint's own values (read from the model's files at the first adapter and kept):
W = W_base + (alpha/r) B A; nothing drifts over versions, whatever was loaded before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from echo2.models.generate import HFEngine
from echo2.models.probe import load_full, probe_logprobs
from echo2.records import Completion, SamplingParams


BATCH_SEQUENCES = 64
"""Most sequences one ``generate`` call of transformers makes at once (the learner's evaluator batches alike): a
pull of training groups is 32 by default, the held-out rows a worker evaluates (run.eval_on=workers) may be
thousands."""


class HFWorkerEngine:
    """A worker's own transformers model behind the worker-engine interface (no vLLM needed)."""

    name = "hf"

    def __init__(self, model_path: str, dtype: str = "float32", pad_token_id: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, **_ignored):
        from transformers import AutoModelForCausalLM

        from echo2.models.tokenizer import load_tokenizer

        self.model_path, self.dtype = model_path, getattr(torch, dtype)
        # the GPU this agent was given (CUDA_VISIBLE_DEVICES), where there is one
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device)
        tok = load_tokenizer(model_path)
        self.engine = HFEngine(tok.pad_token_id if pad_token_id is None else pad_token_id,
                               eos_token_ids or [tok.eos_token_id])
        self.base: dict[str, torch.Tensor] = {}  # the adapted layers' base weights (from the files), kept
        self.off_base = False  # a full snapshot was loaded: the layers no adapter touches are not the base's either
        self.merged: set[str] = set()  # the layers the last adapter was merged into

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.temperature`` 0: greedy (held-out rows), as vLLM reads it. In batches of at most BATCH_SEQUENCES
        sequences (vLLM schedules its own; transformers would pad every held-out row into one batch)."""
        greedy, n = params.temperature == 0, 1 if params.temperature == 0 else params.n
        step = max(1, BATCH_SEQUENCES // n)
        return [group for i in range(0, len(prompt_ids), step)
                for group in self.engine.generate(self.model, prompt_ids[i:i + step], params, greedy=greedy)]

    def load_weights(self, version: int, blob) -> dict:
        from echo2.broadcast.adapter import spec_of
        from echo2.broadcast.snapshot import decode, metadata

        spec = spec_of(metadata(blob))
        if spec is not None:
            return self._merge(version, spec, decode(blob))
        self.off_base = True
        load_full(self.model, decode(blob), f"snapshot v{version}")
        return {}

    @torch.no_grad()
    def _merge(self, version: int, spec, tensors: dict) -> dict:
        from echo2.broadcast.adapter import pairs

        from echo2.broadcast.adapter import base_checkpoint

        modules, adapter = dict(self.model.named_modules()), pairs(tensors)
        for name in adapter:
            if not isinstance(getattr(modules.get(name), "weight", None), torch.Tensor):
                raise ValueError(f"adapter v{version} targets {name!r}, which this model does not have: is this "
                                 "worker's model the learner's base model?")
        if self.off_base:  # back to the base checkpoint everywhere, then the adapter on it
            self.model.load_state_dict(dict(base_checkpoint(self.model_path)), strict=False)
            self.off_base = False
        wanted = {f"{name}.weight" for name in adapter} - {f"{name}.weight" for name in self.base}
        for key, tensor in base_checkpoint(self.model_path, wanted):
            self.base[key.removesuffix(".weight")] = tensor.to(device=self.device, dtype=self.dtype)
        for name in self.merged - set(adapter):  # layers the adapter before adapted and this one does not
            modules[name].weight.copy_(self.base[name])
        for name, (lora_a, lora_b) in adapter.items():
            modules[name].weight.copy_(spec.merged(self.base[name], lora_a, lora_b))
        self.merged = set(adapter)
        return {"merged_modules": len(adapter)}

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return probe_logprobs(self.model, token_ids)

    def close(self) -> None:
        pass
