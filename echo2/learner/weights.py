"""The live policy's weights as a snapshot: streamed one parameter at a time, gathered from shards under ZeRO-3.

A snapshot is written by rank 0 into a path (a memory file the coordinator maps). With one process, or under
ZeRO-2 / DDP, every rank holds the full parameters and rank 0 just streams them. Under ZeRO-3 each parameter is
partitioned: every rank enters ``deepspeed.zero.GatheredParameters([p])`` for one parameter at a time, in the
snapshot's write order (``snapshot.order``), and only rank 0 keeps what it gathered, until it is written. So the
most any rank holds beyond its shard is one full parameter (as TRL's ``sync_weights`` does); rank 0's snapshot
bytes (one full copy) live in the memory file.

The probe (the policy's logprobs of fixed tokens, which a worker reproduces before claiming the version) is one
forward pass; under ZeRO-3 it is a collective (each layer's parameters are gathered by DeepSpeed's hooks), so every
rank runs it.

A LoRA policy (a PEFT model, ``learner.lora``) publishes only its adapter: the LoRA matrices under PEFT's saved
names and the adapter's configuration in the snapshot's metadata (echo2/broadcast/adapter.py). Under ZeRO-3 only
those parameters are gathered, one at a time, never the base model (whose copy TRL's merged-weights sync
materializes whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from echo2.broadcast import snapshot
from echo2.broadcast.adapter import AdapterSpec, saved_name


def zero3(model: Any) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitions (DeepSpeed tags each with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


class PolicyWeights:
    """What ``AsyncRolloutSource`` publishes (``seams.Weights``). Every learner rank builds one and calls
    ``probe_logprobs`` then ``write`` together; ``write`` on a rank other than 0 takes ``path=None`` and only joins
    the gathers."""

    def __init__(self, model: Any, dtype: torch.dtype, rank: int = 0, unsharded: Any = None,
                 adapter: AdapterSpec | None = None):
        """``adapter``: the policy is a LoRA adapter on a frozen base (a PEFT model): only the adapter is written."""
        self.model, self.torch_dtype, self.rank, self.adapter = model, dtype, rank, adapter
        self.unsharded = unsharded or contextlib.nullcontext  # () -> context with full parameters, hooks off
        self.dtype = str(dtype).removeprefix("torch.")  # stated in the snapshot's manifest (probe["dtype"])
        # The probe computes in float32 (probe_logprobs), but under ZeRO-3, where DeepSpeed's own hooks gather each
        # layer, in the weights' dtype (bf16 in DeepSpeed's bf16 mode): stated in the manifest (probe["compute_dtype"])
        # so that a worker's tolerance allows for a half-precision probe as for a half-precision engine.
        self.sharded = zero3(model)
        self.compute_dtype = "float32" if not self.sharded else \
            str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        self.base_dtype = self.dtype  # a full snapshot leaves nothing out
        self.device = next(model.parameters()).device.type  # where the learner computes (and its probe would run)
        if adapter is not None:
            self.tensors: dict[str, Any] = {saved: p for n, p in model.named_parameters()
                                            if (saved := saved_name(n)) and ".default." in n}
            if not self.tensors:
                raise ValueError("learner.lora is set but the model has no LoRA parameters of the default adapter")
            # the frozen base, which a probe computed beside the coordinator must hold as this learner does
            self.base_dtype = str(next(p.dtype for n, p in model.named_parameters()
                                       if saved_name(n) is None)).removeprefix("torch.")
        else:
            # Each tensor once (a tied LM head is its embedding: named_parameters lists it under its first name, as
            # snapshot._unique does for a state dict), then persistent buffers; in state-dict order.
            self.tensors = dict(model.named_parameters())
            buffers = self._buffer_keys()
            self.tensors.update({n: b for n, b in model.named_buffers() if n in buffers})
        self.local = not self.sharded  # rank 0 can write it alone (a coordinator restart republishes at once)
        self.written = False  # whether write() has started: its gathers are collectives, joined once per publish

    def _buffer_keys(self) -> set[str]:
        """State-dict keys that are buffers (persistent ones), without calling ``state_dict()``."""
        keys = set()
        for prefix, module in self.model.named_modules():
            non_persistent = getattr(module, "_non_persistent_buffers_set", set())
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in non_persistent:
                    keys.add(f"{prefix}.{name}" if prefix else name)
        return keys

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        def shape(t):
            return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)

        return {n: (self.torch_dtype if t.is_floating_point() else t.dtype, shape(t)) for n, t in self.tensors.items()}

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) at temperature 1 under the live weights (all ranks, together), computed
        in float32 (``compute_dtype``). Under one-process mixed precision (``learner.bf16``) accelerate wraps the
        model's forward in bf16 autocast and keeps the plain one as ``_original_forward``: the probe takes the plain
        one, so that it describes the weights the snapshot rounds, not one more rounding of every activation (on
        SmolLM2-135M autocast alone moved a probe token by 0.18 nats, and a worker serving the bf16 snapshot in
        float32 was 0.20-0.28 nats from an autocast probe: past its tolerance, it stopped claiming versions). For the
        same reason weights held in bf16 (a LoRA learner's frozen base) are read in float32 (``float32_compute``)."""
        from echo2.models.probe import float32_compute, probe_logprobs

        model, plain = self.model, self.model.__dict__.get("_original_forward")
        exact = float32_compute(model) if not self.sharded else contextlib.nullcontext()
        with torch.no_grad(), exact:
            if plain is None:
                return probe_logprobs(model, token_ids)
            wrapped, model.forward = model.forward, plain
            try:
                return probe_logprobs(model, token_ids)
            finally:
                model.forward = wrapped

    def gathered(self, specs: dict) -> Iterator[torch.Tensor]:
        """The full tensors in write order, cast to the snapshot dtype, one at a time (all ranks, together). On
        ranks other than 0 the gathered parameter is released at once."""
        for name in snapshot.order(specs):
            t = self.tensors[name]
            if self.sharded and hasattr(t, "ds_id") and t.ds_status.name != "AVAILABLE":
                import deepspeed

                with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                    out = t.detach().to(device="cpu", dtype=specs[name][0], copy=True) if self.rank == 0 else None
            else:
                out = t.detach().to(device="cpu", dtype=specs[name][0]) if self.rank == 0 else None
            yield out

    def write(self, path: str | None) -> None:
        """Rank 0: stream the snapshot into ``path``. Other ranks (``path=None``): join each parameter's gather."""
        self.written = True
        specs = self.specs()
        if path is None:
            for _ in self.gathered(specs):
                pass
            return
        snapshot.save_stream(specs, self.gathered(specs), path,
                             metadata=self.adapter.metadata() if self.adapter else None)
