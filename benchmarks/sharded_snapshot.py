"""Snapshot publishing from a ZeRO-3 learner at real model shape: gather + stream vs gathering everything at once.

    python benchmarks/sharded_snapshot.py [--layers 28] [--dtype bfloat16]   # starts 2 x 2 processes itself

A randomly initialised model with Qwen3-0.6B's shape (tied embeddings, 151,936-token vocabulary, hidden 1024,
28 layers, intermediate 3072, 16 query / 8 key-value heads of 128; built locally, no hub) is created partitioned
over the ranks (``deepspeed.zero.Init``: no rank ever holds it whole) and wrapped by DeepSpeed ZeRO-3 over gloo
(no optimizer: this measures publishing, not training). Then, as the learner does every κ steps:

* ``streamed`` (echo2): the probe forward on every rank, then ``PolicyWeights.write``: one parameter gathered at a
  time, rank 0 writing it into a memory file in the snapshot dtype;
* ``all at once`` (baseline, what ``accelerator.get_state_dict`` / a consolidated 16-bit save does): every
  parameter gathered together, rank 0 copying the state dict out, then encoding it.

Per rank it prints the wall time and the growth of peak RSS (ru_maxrss) over the rank's peak before, next to the
snapshot's size and the largest single parameter. RSS does not count the memory file the streamed snapshot is
written into (its pages are shared memory, written, not mapped): that is the snapshot size, on rank 0 only. Each
mode runs in a fresh pair of processes, since a peak only grows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def qwen3_config(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=4096, torch_dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", default="bfloat16", help="snapshot dtype (what the workers serve)")
    ap.add_argument("--mode", choices=["streamed", "at_once"], default="streamed")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()

    import deepspeed
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.learner.weights import PolicyWeights

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = AutoModelForCausalLM.from_config(qwen3_config(args.layers), dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    module = engine.module
    build_s = time.perf_counter() - t0
    n_params = sum(p.ds_numel for p in module.parameters())
    dtype = getattr(torch, args.dtype)
    largest = max(p.ds_numel for p in module.parameters()) * dtype.itemsize

    torch.distributed.barrier()
    base = rss_peak_bytes()
    t0 = time.perf_counter()
    probe_s = size = 0
    if args.mode == "streamed":
        weights = PolicyWeights(module, dtype, rank=rank)
        weights.probe_logprobs(list(range(1, 34)))
        probe_s = time.perf_counter() - t0
        fd = os.memfd_create("bench-snapshot") if rank == 0 else None
        weights.write(f"/proc/self/fd/{fd}" if rank == 0 else None)
        size = os.fstat(fd).st_size if rank == 0 else 0
    else:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().to(dtype).clone() for k, v in module.state_dict().items()} if rank == 0 else None
        size = len(snapshot.encode(state)) if rank == 0 else 0
    total_s = time.perf_counter() - t0
    rows = [None] * world
    torch.distributed.all_gather_object(rows, (rank, probe_s, total_s, rss_peak_bytes() - base, base))
    if rank == 0:
        meta = dict(params=n_params, build_s=build_s, size=size, largest=largest)
        print("RESULT " + json.dumps({"mode": args.mode, **meta, "rows": rows}), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def compare(layers: int, dtype: str) -> None:
    """Both modes, each in a fresh pair of processes (peak RSS only grows), and the table."""
    results = {}
    for mode in ("streamed", "at_once"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29400 + os.getpid() % 500), __file__, "--worker", "--mode", mode, "--layers", str(layers),
               "--dtype", dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(line[len("RESULT "):])
    gib = 2**30
    m = results["streamed"]
    print(f"Qwen3-0.6B-shaped, {layers} layers, {m['params'] / 1e6:.0f}M parameters, ZeRO-3 x 2 (gloo, CPU), built "
          f"partitioned in {m['build_s']:.0f} s; snapshot ({dtype}) {m['size'] / gib:.2f} GiB; largest parameter "
          f"{m['largest'] / gib:.3f} GiB")
    print(f"{'mode':>9} | {'rank':>4} | {'probe s':>7} | {'publish s':>9} | {'peak RSS before GiB':>19} | {'+peak GiB':>9}")
    for mode, r in results.items():
        for rank, probe_s, total_s, grow, base in sorted(r["rows"]):
            print(f"{mode:>9} | {rank:>4} | {probe_s:7.1f} | {total_s:9.1f} | {base / gib:19.2f} | {grow / gib:9.2f}")
    print("bound (streamed): rank 0 +peak <= snapshot + one parameter; other ranks <= one parameter (+ the probe's "
          "activations)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        main()
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--layers", type=int, default=28)
        ap.add_argument("--dtype", default="bfloat16")
        a = ap.parse_args()
        compare(a.layers, a.dtype)
