"""What a LoRA policy saves per version, and how a worker should apply it: merged into its weights, or vLLM's LoRA.

On one real model (SmolLM2-135M-Instruct, the offline copy; ``--quick``: the tiny model), in one run:

1. **Publish** (the learner's side): the learner is built as ``train.py`` builds it (sync source, so no workers),
   trained ``--steps`` optimizer steps, and after each its snapshot is written as the broadcaster gets it (a memory
   file): full float32, full bf16, and LoRA adapters of rank 1, 8 and 32 on every linear layer. Per version: bytes,
   write time (probe excluded), and the sparse delta against the version before (echo2/broadcast/delta.py: what the
   relay sends when it pays), from real optimizer steps at the experiment's learning rate.
2. **Apply** (the worker's side), each snapshot of step 2 applied and proven (probe logprobs against the learner's):
   the transformers engine (load_state_dict, or the adapter merged into its weights), a vLLM server merging the adapter
   inside the engine (``--lora merge``, the default), and a vLLM server with vLLM's LoRA layers loading it under a
   versioned name (``--lora vllm``).
3. **Generate**: tokens per second of the same prompts on the vLLM server without LoRA (holding the merged adapter:
   the same speed as the base model) and the one serving through vLLM's LoRA layers, alternating, ``--rounds``
   each; and each server's memory (PSS of its process tree) after the adapters were loaded.
4. **Shapes**: bytes per version for Qwen3-0.6B, 4B and 8B from their published configurations (bf16), full against
   rank 1, 8 and 32 on every linear layer, and the time each takes over 10 Mbit/s and 100 Mbit/s; ``--qwen06b`` also
   measures a rank-8 adapter's publish and merge at Qwen3-0.6B's shape with random weights.

    python benchmarks/lora.py                      # SmolLM2-135M (~10 minutes on 2 cores)
    python benchmarks/lora.py --quick              # the tiny model: seconds, for a smoke check
    python benchmarks/lora.py --qwen06b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RANKS = (1, 8, 32)
# Published configurations (config.json on the hub): hidden, MLP, layers, query heads, key/value heads, head dim, vocab
QWEN3 = {"Qwen3-0.6B": (1024, 3072, 28, 16, 8, 128, 151_936, True),
         "Qwen3-4B": (2560, 9728, 36, 32, 8, 128, 151_936, True),
         "Qwen3-8B": (4096, 12288, 36, 32, 8, 128, 151_936, False)}


def shape_bytes(hidden, mlp, layers, heads, kv, head_dim, vocab, tied, rank=None, itemsize=2) -> int:
    """Bytes of a Qwen3-shaped model (rank None) or of a LoRA adapter of ``rank`` on every linear layer (the cost
    scenario's formula, echo2/cost.py)."""
    from echo2.cost import linear_params, lora_params

    q, k = heads * head_dim, kv * head_dim
    if rank is not None:
        return lora_params(hidden, q, k, mlp, layers, rank) * itemsize
    norms = layers * (2 * hidden + 2 * head_dim)  # two per block, and the q/k norms
    return (linear_params(hidden, q, k, mlp, layers) + norms + vocab * hidden * (1 if tied else 2) + hidden) * itemsize


def written(weights) -> tuple[bytes, float]:
    """The snapshot as the broadcaster gets it (a memory file written by PolicyWeights.write), and the write's s."""
    from echo2.broadcast import snapshot

    fd, path = snapshot.new_memory_fd()
    try:
        t0 = time.perf_counter()
        weights.write(path)
        seconds = time.perf_counter() - t0
        with open(path, "rb") as f:
            return f.read(), seconds
    finally:
        os.close(fd)


def publish(model_overrides: list[str], kinds: list[tuple[str, list[str], bool]], steps: int) -> dict:
    """Train each kind ``steps`` steps with the sync source; each version's snapshot, its write time, its delta."""
    import torch
    from transformers import TrainerCallback

    import train
    from echo2.broadcast import delta
    from step_time import compose

    out = {}
    for name, overrides, bf16 in kinds:
        cfg = compose(["rollout=sync", "run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0",
                       "run.save_every_steps=0", f"run.steps={steps}", *model_overrides, *overrides])
        trainer, _, _ = train.build(cfg, str(Path("/tmp") / f"echo2-lora-bench-{name}"), rank=0, world_size=1)
        versions: list[tuple[bytes, float]] = []

        class Keep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                weights = trainer.weights()
                if bf16:
                    weights.torch_dtype, weights.dtype = torch.bfloat16, "bfloat16"
                versions.append(written(weights))

        trainer.add_callback(Keep())
        trainer.train()
        word = 2 if bf16 else 4
        ratios = [len(delta.choose(new, old, v, word)[1]) / len(new)
                  for v, ((new, _), (old, _)) in enumerate(zip(versions[1:], versions[:-1]), 1)]
        out[name] = {"bytes": len(versions[-1][0]), "write_s": statistics.median(s for _, s in versions),
                     "delta_ratio": statistics.median(ratios) if ratios else None,
                     "snapshot": versions[-1][0], "trainer": trainer}
        print(f"  {name}: {len(versions[-1][0]) / 1e6:.2f} MB, write {out[name]['write_s']:.3f} s, delta/full "
              f"{out[name]['delta_ratio']}", flush=True)
    return out


def probe_of(trainer) -> dict:
    from echo2.models.probe import probe_tokens

    ids = probe_tokens(len(trainer.processing_class))
    weights = trainer.weights()
    return {"token_ids": ids, "logprobs": weights.probe_logprobs(ids), "dtype": "float32",
            "adapter": weights.adapter is not None}


def apply_one(engine, version: int, blob: bytes, probe: dict) -> tuple[float, float]:
    """(apply s, probe |engine - learner| max) for one snapshot, through the agent's own apply path."""
    from echo2.broadcast import snapshot
    from echo2.worker.agent import Agent

    agent = Agent("http://127.0.0.1:9", "secret", engine)
    try:
        agent._received(version, snapshot.memory_file(blob), {"probe": probe})
        t0 = time.perf_counter()
        agent._apply_pending()
        seconds = time.perf_counter() - t0
        return seconds, agent._probe_error(probe)
    finally:
        agent.receiver.close()


def tokens_per_s(engine, prompts, params, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, params)
        out.append(sum(len(c.token_ids) for g in groups for c in g) / (time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny model (a smoke check; its figures mean little)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="generation rounds per server, alternating")
    p.add_argument("--qwen06b", action="store_true", help="also measure a rank-8 adapter at Qwen3-0.6B's shape")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from echo2.env import configure_process, descendants
    from echo2.models.tokenizer import stop_token_ids
    from echo2.records import SamplingParams
    from echo2.scoring import encode_prompt
    from echo2.worker.engines.hf import HFWorkerEngine
    from echo2.worker.engines.vllm_server import VLLMServerEngine
    from weight_apply import pss_bytes

    configure_process()
    model = ["model=tiny"] if args.quick else ["experiment=smollm2_arith"]
    lr = [] if args.quick else ["learner.learning_rate=1e-4"]  # LoRA's rate: about 10x full fine-tuning's 1e-5
    kinds = [("full fp32", [], False), ("full bf16", [], True)]
    kinds += [(f"lora r{r}", [f"learner.lora.rank={r}", *lr], False) for r in RANKS]
    print(f"1. publish ({'tiny model' if args.quick else 'SmolLM2-135M'}, {args.steps} real steps each)", flush=True)
    pub = publish(model, kinds, args.steps)
    full = pub["full fp32"]["trainer"]
    model_path = full.model.config._name_or_path
    results: dict = {"publish": {k: {x: v[x] for x in ("bytes", "write_s", "delta_ratio")} for k, v in pub.items()}}

    print("2. apply, 3. generate", flush=True)
    tok = full.processing_class
    from echo2.tasks.arith_chat import ArithChatTask

    rows = list(ArithChatTask(train_size=16).train_dataset())
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows] if not args.quick else [[5, 6, 7]] * 16
    params = SamplingParams(n=4, max_tokens=64 if not args.quick else 2, temperature=1.0,
                            stop_token_ids=tuple(stop_token_ids(tok, model_path)))
    context = max(len(x) for x in prompts) + params.max_tokens + 8
    servers = {"vllm merge": VLLMServerEngine(model_path, max_model_len=context),
               "vllm lora": VLLMServerEngine(model_path, max_model_len=context, lora="vllm", max_lora_rank=32)}
    hf = HFWorkerEngine(model_path)
    apply: dict = {}
    try:
        version = 0
        probes = {kind: probe_of(pub[kind]["trainer"]) for kind in pub}
        for rep in range(args.rounds + 1):  # the first round warms each engine up (vLLM's first LoRA load) and is
            for kind in ("lora r1", "lora r8", "lora r32", "full fp32"):  # not counted
                for name, engine in {"hf": hf, **servers}.items():
                    if name == "vllm lora" and kind.startswith("full"):
                        continue  # a full snapshot is the same apply on either server
                    version += 1
                    s, err = apply_one(engine, version, pub[kind]["snapshot"], probes[kind])
                    if rep:
                        apply.setdefault(f"{kind} / {name}", []).append((s, err))
        apply = {k: (statistics.median(s for s, _ in v), max(e for _, e in v)) for k, v in apply.items()}
        for k, (s, e) in apply.items():
            print(f"  {k}: {s:.3f} s, probe {e:.2g}", flush=True)
        # generation, alternating: the merge server holds a full snapshot, then a merged rank-32 adapter (the base
        # model's speed either way); the LoRA server the rank-32 adapter, then the rank-8 one
        speed: dict[str, list[float]] = {"base (merged adapter)": [], "vllm lora r32": [], "vllm lora r8": []}
        for _ in range(args.rounds):
            speed["base (merged adapter)"] += tokens_per_s(servers["vllm merge"], prompts, params, 1)
            speed["vllm lora r32"] += tokens_per_s(servers["vllm lora"], prompts, params, 1)
        version += 1
        apply_one(servers["vllm merge"], version, pub["lora r32"]["snapshot"], probes["lora r32"])  # merged: base speed
        apply_one(servers["vllm lora"], version, pub["lora r8"]["snapshot"], probes["lora r8"])
        for _ in range(args.rounds):
            speed["base (merged adapter)"] += tokens_per_s(servers["vllm merge"], prompts, params, 1)
            speed["vllm lora r8"] += tokens_per_s(servers["vllm lora"], prompts, params, 1)
        memory = {name: pss_bytes([e.proc.pid, *descendants(e.proc.pid)]) for name, e in servers.items()}
    finally:
        for engine in servers.values():
            engine.close()
    results.update(apply={k: {"s": s, "probe": e} for k, (s, e) in apply.items()},
                   tokens_per_s={k: statistics.median(v) for k, v in speed.items()}, memory_bytes=memory)

    print("\n| snapshot | bytes | write s | delta / full |")
    print("|---|---:|---:|---:|")
    for k, v in results["publish"].items():
        d = "-" if v["delta_ratio"] is None else f"{v['delta_ratio']:.3f}"
        print(f"| {k} | {v['bytes'] / 1e6:.2f} MB | {v['write_s']:.3f} | {d} |")
    print("\n| snapshot / engine | apply s (median, with the probe) | probe max abs diff nats |")
    print("|---|---:|---:|")
    for k, v in results["apply"].items():
        print(f"| {k} | {v['s']:.3f} | {v['probe']:.2g} |")
    base = results["tokens_per_s"]["base (merged adapter)"]
    print(f"\n| vLLM server | tokens/s (median of {args.rounds}) | vs base | memory (PSS) |")
    print("|---|---:|---:|---:|")
    for k, v in results["tokens_per_s"].items():
        mem = memory["vllm merge" if k.startswith("base") else "vllm lora"]
        print(f"| {k} | {v:.0f} | {v / base:.2f} | {mem / 2**30:.2f} GiB |")

    print("\n| model (bf16) | full | r1 | r8 | r32 | full at 10 / 100 Mbit/s | r8 at 10 / 100 Mbit/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    shapes = {}
    for name, shape in QWEN3.items():
        sizes = {r: shape_bytes(*shape, rank=r) for r in (None, *RANKS)}
        shapes[name] = {str(k): v for k, v in sizes.items()}
        at = lambda b, mbit: b * 8 / (mbit * 1e6)  # noqa: E731
        print(f"| {name} | {sizes[None] / 1e9:.2f} GB | {sizes[1] / 1e6:.2f} MB | {sizes[8] / 1e6:.1f} MB | "
              f"{sizes[32] / 1e6:.0f} MB | {at(sizes[None], 10):.0f} / {at(sizes[None], 100):.0f} s | "
              f"{at(sizes[8], 10):.1f} / {at(sizes[8], 100):.2f} s |")
    results["shapes"] = shapes
    if args.qwen06b:
        results["qwen3_0.6b_measured"] = qwen06b()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def qwen06b() -> dict:
    """A rank-8 adapter at Qwen3-0.6B's shape (random weights, built locally): its bytes against the shape formula,
    the learner's write time, and the hf engine's merge (apply) time."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.broadcast.adapter import AdapterSpec
    from echo2.learner.weights import PolicyWeights
    from echo2.models.tiny import build_tiny
    from echo2.worker.engines.hf import HFWorkerEngine
    from scale_step import QWEN3_06B

    path = build_tiny(**dict(QWEN3_06B, num_hidden_layers=28))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    weights = PolicyWeights(model, torch.bfloat16, adapter=AdapterSpec.of_peft(model.peft_config["default"]))
    blob, write_s = written(weights)
    engine = HFWorkerEngine(path)
    from echo2.broadcast import snapshot

    t0 = time.perf_counter()
    engine.load_weights(1, snapshot.memory_file(blob))
    out = {"bytes": len(blob), "formula_bytes": shape_bytes(*QWEN3["Qwen3-0.6B"], rank=8), "write_s": write_s,
           "hf_merge_s": time.perf_counter() - t0}
    print(f"\nQwen3-0.6B shape, rank 8, bf16: {out['bytes'] / 1e6:.2f} MB (formula {out['formula_bytes'] / 1e6:.2f} MB), "
          f"write {write_s:.3f} s, hf merge {out['hf_merge_s']:.3f} s")
    return out


if __name__ == "__main__":
    main()
