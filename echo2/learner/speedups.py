"""Two places where the learner has TRL and PEFT compute the same values with less work.

Neither changes a number: each skips work whose result is thrown away or undone (tests/learner/test_trl_contract.py
and tests/learner/test_lora.py compare the values and gradients with and without). Both were found by profiling the
learner's step on SmolLM2-135M (BENCHMARKS.md, "Scoring only the completions" and "Less work per LoRA step on both
sides"); both are applied by ``Echo2GRPOTrainer`` as it is built.
"""

from __future__ import annotations

import torch


def score_completions_only_on_cpu() -> None:
    """Make TRL's fused LM head score only the completion tokens on the CPU, as it does on CUDA.

    TRL's head (``trl.trainer.utils.add_fused_lm_head``) projects the hidden states through the LM head in tiles
    and takes each token's log-probability. Where Triton runs (CUDA, XPU) it scores only the positions whose label
    is kept (the completion tokens). Elsewhere it scores every position of the padded batch, prompt and padding
    included, so that a compiling backend (Neuron) sees one tile shape per batch. Nothing is compiled on the CPU,
    and a short-completion batch pays several times over for the head: with SmolLM2-135M's 49,152-token vocabulary
    the head's forward and backward were half of a learner step. Scoring only the completions made
    ``smollm2_arith``'s step 1.65x faster with full fine-tuning in bf16 (1.38x in float32) and 1.41x with a LoRA
    adapter; the log-probabilities and gradients are the same. TRL decides through ``_use_triton``, which
    ``trl.trainer.utils`` uses for this choice alone; the chunked kernel keeps its own copy, so the CPU still folds
    its tiles in torch. Idempotent; every other device is left to TRL."""
    import trl.trainer.utils as trl_utils

    decide = trl_utils._use_triton
    if hasattr(decide, "trl_decides"):
        return

    def compact_on_cpu(device: torch.device) -> bool:
        return device.type == "cpu" or decide(device)

    compact_on_cpu.trl_decides = decide  # TRL's own, for a test to compare against
    trl_utils._use_triton = compact_on_cpu


def _uncast_under_autocast(module: torch.nn.Module, args: tuple) -> None:
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not module.lora_variant and torch.is_autocast_enabled(x.device.type):
        module._echo2_cast_was = module.cast_input_dtype_enabled
        module.cast_input_dtype_enabled = False


def _restore_cast(module: torch.nn.Module, args: tuple, output) -> None:
    was = module.__dict__.pop("_echo2_cast_was", None)
    if was is not None:
        module.cast_input_dtype_enabled = was


def adapter_inputs_uncast_under_autocast(model: torch.nn.Module) -> int:
    """Have each LoRA layer of ``model`` skip PEFT's cast of its input to the adapter's dtype whenever autocast is on
    for that forward; return how many layers were set so (0 for a model without LoRA layers).

    Under ``learner.bf16`` a LoRA learner keeps its frozen base in bf16 and trains a float32 adapter, so the hidden
    states reach every adapted layer in bf16. PEFT casts them to the adapter's float32 before its first matmul, and
    autocast casts them straight back to bf16 for that matmul: two copies of the layer's input in the forward and two
    in the backward, in each of the 210 adapted layers of SmolLM2-135M, for the very values the matmul would have
    had anyway (bf16 -> float32 -> bf16 is exact, and under autocast a linear casts every input to autocast's dtype
    whatever it was given). PEFT offers the switch (``cast_input_dtype_enabled``, its ``disable_input_dtype_casting``);
    here it is off only inside a forward that runs under autocast, so a forward without autocast (the probe in
    float32, a bf16 forward of the same model) still gets PEFT's cast. Layers with a LoRA variant (DoRA) keep it:
    their extra arithmetic is not all autocast's. Idempotent."""
    from peft.tuners.lora.layer import Linear

    hooked = 0
    for module in model.modules():
        if not isinstance(module, Linear) or getattr(module, "_echo2_uncast", False):
            continue
        module.register_forward_pre_hook(_uncast_under_autocast)
        module.register_forward_hook(_restore_cast, always_call=True)
        module._echo2_uncast = True
        hooked += 1
    return hooked
