"""What the probe costs a LoRA learner, by how its frozen base is held: SmolLM2-135M-Instruct with a rank-8 adapter on
every linear layer, the probe's 33 tokens, one thread.

    taskset -c 0 python benchmarks/probe_cost.py [--rounds 3] [--reps 5]

Three ways, alternating round by round in one process: the base in float32 (a learner.bf16 LoRA learner before its
base stayed in model.dtype), the base in bf16 read in bf16 (one more rounding of every activation: too far from a
float32 worker), and the base in bf16 read in float32 (``echo2.models.probe.float32_compute``, what the learner does
now). Each round prints the median of ``--reps`` probes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.env import configure_process
    from echo2.models.packaged import from_gguf_wheel
    from echo2.models.probe import float32_compute, probe_logprobs, probe_tokens

    configure_process()
    path = from_gguf_wheel()

    def lora(dtype):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
        return get_peft_model(base, LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")).eval()

    models = {dtype: lora(dtype) for dtype in (torch.float32, torch.bfloat16)}
    ids = probe_tokens(models[torch.float32].get_input_embeddings().weight.shape[0])
    ways = {"base float32": (models[torch.float32], nullcontext),
            "base bf16, read in bf16": (models[torch.bfloat16], nullcontext),
            "base bf16, read in float32": (models[torch.bfloat16], float32_compute)}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(a.rounds):
        for way, (model, reading) in ways.items():
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                with torch.no_grad(), reading(model):  # nullcontext(model) or float32_compute(model)
                    probe_logprobs(model, ids)
                times.append(time.perf_counter() - t0)
            seconds[way].append(statistics.median(times))
    print("| the base | probe s, each round |\n|---|---|")
    for way, s in seconds.items():
        print(f"| {way} | {', '.join(f'{x:.3f}' for x in s)} |")


if __name__ == "__main__":
    main()
