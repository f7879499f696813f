"""One real run at Qwen3-0.6B's shape: a ZeRO-3 learner on 2 processes training from vLLM workers, measured.

    python benchmarks/scale_step.py                          # 28 layers, 2 vLLM workers, 4 steps, bf16 snapshots
    python benchmarks/scale_step.py --layers 2 --workers 1   # smaller, same path
    python benchmarks/scale_step.py --tiny                   # the demo's tiny model on the same path

It starts ``launchers/learner.sh 2 learner=zero3`` with the async rollout source and ``pool.engine=vllm`` as a user
would, on a randomly initialised model with Qwen3-0.6B's shape (tied embeddings, 151,936-token vocabulary, hidden
1024, 28 layers, intermediate 3072, 16 query / 8 key-value heads of 128; built locally once, no hub), and watches
every process of the run. It prints:

* seconds per learner step, split into train (forward, backward, optimizer), gather + publish (the snapshot
  streamed out of the ZeRO-3 shards, the probe forward, the hand-off to the relay) and wait (the learner idle
  for rollouts), from the run's own metrics.jsonl; the first step (engine start-up, first snapshot) is shown but
  left out of the medians;
* the snapshot's bytes and each worker's time to apply it to its running engine (from the workers' logs);
* the peak RSS of every process of the run (learner ranks, coordinator process, agents, vLLM servers and their
  engine processes) next to the snapshot size, and the peak of the whole run's memory (the sum of the processes'
  PSS, which counts a shared page once), against the machine's memory.

Rollouts are arith copy prompts with ``--completion-tokens`` sampled tokens each (the random model never stops
early), P=4 prompts x G=4 per step, so every rank trains on 8 rollouts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30

QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=128)


def model_overrides(layers: int, tiny: bool) -> tuple[list[str], dict]:
    if tiny:
        return ["model=tiny"], {}
    shape = dict(QWEN3_06B, num_hidden_layers=layers)
    return ["model=tiny", f"model.name=qwen3-0.6b-shape-{layers}l",
            *(f"model.path.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items())], shape


def role(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    name = p.name()
    if "train.py" in cmd and "accelerate" not in cmd:
        return f"learner rank {p.environ().get('LOCAL_RANK', '?')}"
    if "multiprocessing" in cmd:  # the learner's coordinator process, or (under a worker) a vLLM engine process
        return "spawned"
    if "engines.guard" in cmd:
        return "engine guard"
    if "echo2.worker" in cmd:
        return "agent"
    if "vllm.entrypoints" in cmd:
        return "vLLM API server"
    if name.startswith("VLLM::") or "VLLM::" in cmd:
        return name
    if "accelerate" in cmd:
        return "launcher"
    if name in ("cc1plus", "cc", "c++", "g++", "ld"):
        return "compiler (JIT build of an op)"
    return f"{name} {' '.join(p.cmdline()[1:3])}"[:34]


class Watcher(threading.Thread):
    """Samples the run's process tree: the peak RSS of each process, and the peak sum of PSS (shared pages once)."""

    def __init__(self, root_pid: int, interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.interval_s, self.done = psutil.Process(root_pid), interval_s, threading.Event()
        self.procs: dict[int, dict] = {}
        self.peak_pss = 0

    def run(self):
        while not self.done.is_set():
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in tree:
                try:
                    mem = p.memory_full_info()
                    info = self.procs.setdefault(p.pid, {"role": role(p), "parent": p.ppid(), "peak_rss": 0})
                    info["peak_rss"] = max(info["peak_rss"], mem.rss)
                    total += mem.pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_pss = max(self.peak_pss, total)
            self.done.wait(self.interval_s)

    def worker_of(self, pid: int) -> str:
        """'worker i' for an agent and everything under it (numbered by agent pid), else ''."""
        agents = sorted(p for p, i in self.procs.items() if i["role"] == "agent")
        while pid in self.procs:
            if pid in agents:
                return f"worker {agents.index(pid)}"
            pid = self.procs[pid]["parent"]
        return ""


def steps_table(run_dir: Path) -> list[dict]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    records = [r for r in records if "train/learner_idle_s" in r]
    rows, last = [], 0.0
    for r in records:
        step_s = r["time_s"] - last
        last = r["time_s"]
        wait, publish = r["train/learner_idle_s"], r.get("train/publish_s", 0.0)
        rows.append({"step": r["step"], "step_s": step_s, "wait_s": wait, "publish_s": publish,
                     "train_s": step_s - wait - publish})
    return rows


APPLIED = re.compile(r"applied snapshot v(\d+) \(([\d.]+) MB\) in ([\d.]+) s")


def applies(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    out = {}
    for log in sorted((run_dir / "workers").glob("worker*[0-9].log")):  # the agents' logs, not their engines'
        out[log.stem] = [(int(v), float(mb), float(s)) for v, mb, s in APPLIED.findall(log.read_text(errors="replace"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny model instead of the Qwen3-0.6B shape")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--completion-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="bfloat16: fp32 master weights, bf16 compute and snapshots, vLLM serving bf16; float32: all fp32")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for the run")
    args = ap.parse_args()

    overrides, shape = model_overrides(args.layers, args.tiny)
    t0 = time.perf_counter()
    print("building the model (once; cached)...", flush=True)
    # in a process of its own: building holds the whole model, which this watcher must not keep for the run
    model_dir = subprocess.run([sys.executable, "-c", f"from echo2.models.tiny import build_tiny; "
                                f"print(build_tiny(**{shape!r}))"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.split()[-1]
    print(f"model at {model_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)

    precision = (["learner.bf16=true", "pool.dtype=bfloat16"] if args.dtype == "bfloat16" and not args.tiny
                 else ["pool.dtype=float32"])
    run_dir = Path(args.run_dir or f"outputs/bench-scale-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    cmd = ["launchers/learner.sh", "2", "learner=zero3", "rollout=async", "pool.engine=vllm",
           f"pool.workers={args.workers}", f"run.steps={args.steps}", "run.eval_every_steps=0", "run.progress=false",
           "run.save_every_steps=0", "task.level=copy", f"task.max_completion_length={args.completion_tokens}",
           "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.source.min_workers="
           f"{args.workers}", *overrides, *precision, *args.overrides]
    env = dict(os.environ, ECHO2_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    run_dir.mkdir(parents=True, exist_ok=True)
    print("running: " + " ".join(cmd), flush=True)
    base_used = psutil.virtual_memory().total - psutil.virtual_memory().available
    with open(run_dir / "launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        watcher = Watcher(proc.pid)
        watcher.start()
        peak_used = base_used
        while proc.poll() is None:
            vm = psutil.virtual_memory()
            peak_used = max(peak_used, vm.total - vm.available)
            time.sleep(1.0)
        watcher.done.set()
        watcher.join()
    if proc.returncode != 0:
        tail = (run_dir / "launcher.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"the run failed (exit {proc.returncode}); {run_dir}/launcher.log ends:\n{tail}")

    rows = steps_table(run_dir)
    applied = applies(run_dir)
    snapshot_mb = max((mb for a in applied.values() for _, mb, _ in a), default=float("nan"))
    label = "tiny model" if args.tiny else f"Qwen3-0.6B shape, {args.layers} layers"
    print(f"\n{label}; ZeRO-3 x 2 learner (gloo, CPU), {args.workers} vLLM worker(s), {args.dtype}, "
          f"P=4 x G=4, {args.completion_tokens} completion tokens; run dir {run_dir}")
    print(f"{'step':>4} | {'step s':>7} | {'train s':>7} | {'gather+publish s':>16} | {'wait s':>7}")
    for r in rows:
        print(f"{r['step']:>4} | {r['step_s']:7.2f} | {r['train_s']:7.2f} | {r['publish_s']:16.2f} | {r['wait_s']:7.2f}")
    later = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in later) for k in ("step_s", "train_s", "publish_s", "wait_s")}
    print(f"{'med':>4} | {med['step_s']:7.2f} | {med['train_s']:7.2f} | {med['publish_s']:16.2f} | {med['wait_s']:7.2f}"
          f"   (steps 2..{len(rows)})")

    print(f"\nsnapshot: {snapshot_mb:.1f} MB")
    for w, a in applied.items():
        times = [s for _, _, s in a]
        print(f"  {w}: {len(a)} snapshots applied, median {statistics.median(times):.2f} s, max {max(times):.2f} s"
              if times else f"  {w}: no snapshot applied")

    print(f"\n{'process':<34} | {'pid':>7} | {'peak RSS GiB':>12} | {'x snapshot':>10}")
    for pid, info in sorted(watcher.procs.items(), key=lambda kv: (watcher.worker_of(kv[0]), kv[0])):
        if info["peak_rss"] < 50 * 2**20:
            continue  # shells, guards and launchers
        worker = watcher.worker_of(pid)
        what = info["role"] if info["role"] != "spawned" else "vLLM engine process" if worker else "coordinator process"
        name = " / ".join(filter(None, [worker, what]))
        print(f"{name:<34} | {pid:>7} | {info['peak_rss'] / GIB:12.2f} | {info['peak_rss'] / 1e6 / snapshot_mb:10.1f}")
    total = psutil.virtual_memory().total
    print(f"\nwhole run, peak sum of PSS: {watcher.peak_pss / GIB:.1f} GiB; machine memory in use rose by at most "
          f"{(peak_used - base_used) / GIB:.1f} GiB (from {base_used / GIB:.1f} GiB, other users included); "
          f"machine total {total / GIB:.1f} GiB")


if __name__ == "__main__":
    main()
