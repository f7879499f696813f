"""What the probe costs a LoRA learner, by how its frozen base is held: SmolLM2-135M-Instruct with a rank-8 adapter on
every linear layer, the probe's 33 tokens, one thread.

    taskset -c 0 python benchmarks/probe_cost.py [--rounds 3] [--reps 5]
    taskset -c 1 python benchmarks/probe_cost.py --beside [--qwen06b] [--reps 5]

Three ways, alternating round by round in one process: the base in float32 (a learner.bf16 LoRA learner before its
base stayed in model.dtype), the base in bf16 read in bf16 (one more rounding of every activation: too far from a
float32 worker), and the base in bf16 read in float32 (``echo2.models.probe.float32_compute``, what the learner does
now). Each round prints the median of ``--reps`` probes.

``--beside``: what the coordinator's probe process spends on each published adapter (``prober.SnapshotProbe``:
the rank-8 adapter's bf16 snapshot loaded into PEFT's layers on the bf16 base, one float32 forward), on SmolLM2-135M,
and with ``--qwen06b`` at Qwen3-0.6B's shape (28 layers, random weights built locally); median of ``--reps``.
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
    p.add_argument("--beside", action="store_true", help="the probe process's time per published adapter")
    p.add_argument("--qwen06b", action="store_true", help="with --beside: also at Qwen3-0.6B's shape")
    a = p.parse_args()
    if a.beside:
        return beside(a.reps, a.qwen06b)
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


def beside(reps: int, qwen06b: bool) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.broadcast.adapter import AdapterSpec
    from echo2.coordinator.prober import SnapshotProbe
    from echo2.env import configure_process
    from echo2.learner.weights import PolicyWeights
    from echo2.models.packaged import from_gguf_wheel
    from echo2.models.probe import probe_tokens

    configure_process()
    paths = {"SmolLM2-135M": from_gguf_wheel()}
    if qwen06b:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from echo2.models.tiny import build_tiny
        from scale_step import QWEN3_06B

        paths["Qwen3-0.6B shape"] = build_tiny(**dict(QWEN3_06B, num_hidden_layers=28))
    print("| model | adapter bytes | probe process s per version (median) |\n|---|---:|---:|")
    for name, path in paths.items():
        learner = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                                 LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
        with torch.no_grad():  # a trained adapter: B moved off zero
            for n, p in learner.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        weights = PolicyWeights(learner, torch.bfloat16, adapter=AdapterSpec.of_peft(learner.peft_config["default"]))
        blob = snapshot.written_bytes(weights.write)
        del learner, weights
        probe = SnapshotProbe(path, "bfloat16")
        ids = probe_tokens(probe.model.get_input_embeddings().weight.shape[0])
        probe(blob, ids)  # the first builds PEFT's layers
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            probe(blob, ids)
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {len(blob) / 1e6:.2f} MB | {statistics.median(times):.3f} |")


if __name__ == "__main__":
    main()
