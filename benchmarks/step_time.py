"""Seconds per learner step, echo2's learner against plain TRL GRPOTrainer on the same problem, same run.

Both generate with transformers on this process (echo2: the sync rollout source, S = 0; TRL: its own
``model.generate`` path), score the same task reward, and take one optimizer step per batch of P x G
completions. The ratio echo2 / TRL is echo2's overhead (or saving); it is what to compare across machines,
since absolute times on shared CPUs move a lot. Rounds alternate the two to spread out machine noise. Both score only
the completion tokens in TRL's fused LM head (``score_completions_only_on_cpu``, which echo2's learner applies to the
whole process; set here before either runs, so that the first round is like the others).

    python benchmarks/step_time.py                       # tiny model, copy task, P=16, G=8
    python benchmarks/step_time.py --steps 40 --rounds 3 task.level=mod10
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


class StepTimer:
    """Wall time between consecutive optimizer steps (generation + scoring + loss + backward + step)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, *a, **k):
                timer.last = time.perf_counter()

            def on_step_end(self, *a, **k):
                now = time.perf_counter()
                timer.steps.append(now - timer.last)
                timer.last = now

        self.steps: list[float] = []
        self.last = 0.0
        self.callback = _Callback()


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from echo2.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def run_echo2(cfg, out_dir) -> list[float]:
    import train

    trainer, source, _ = train.build(cfg, out_dir, rank=0, world_size=1)
    timer = StepTimer()
    trainer.add_callback(timer.callback)
    trainer.train()
    source.close()
    return timer.steps


def run_trl(cfg, out_dir) -> list[float]:
    from hydra.utils import instantiate
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from echo2.learner.args import grpo_config

    model_path = instantiate(cfg.model.path)
    task = instantiate(cfg.task)
    trainer = GRPOTrainer(model=model_path, processing_class=AutoTokenizer.from_pretrained(model_path),
                          reward_funcs=task.reward_funcs(), args=grpo_config(cfg, out_dir, 1),
                          train_dataset=task.train_dataset())
    trainer.remove_callback(PrinterCallback)  # TRL prints every log dict otherwise
    timer = StepTimer()
    trainer.add_callback(timer.callback)
    trainer.train()
    return timer.steps


def main() -> None:
    from echo2.env import configure_process
    from echo2.learner.speedups import score_completions_only_on_cpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="learner steps per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2, help="alternating echo2/TRL rounds")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as for train.py")
    args = parser.parse_args()
    configure_process()
    score_completions_only_on_cpu()
    cfg = compose(["rollout=sync", f"run.steps={args.steps}", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0", *args.overrides])
    times: dict[str, list[float]] = {"echo2": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, fn in (("echo2", run_echo2), ("trl", run_trl)):
                steps = fn(cfg, str(Path(tmp) / f"{name}-{r}"))
                times[name] += steps[args.warmup :]
    med = {k: statistics.median(v) for k, v in times.items()}
    rollouts = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    print(f"\nlearner step time, {cfg.model.name} model, task {cfg.task.level}, R = {rollouts} rollouts/step, "
          f"{args.rounds} rounds x {args.steps - args.warmup} steps each")
    print(f"{'learner':<8} {'median s/step':>14} {'p10':>8} {'p90':>8} {'rollouts/s':>11}")
    for name, vals in times.items():
        q = statistics.quantiles(vals, n=10)
        print(f"{name:<8} {med[name]:>14.4f} {q[0]:>8.4f} {q[-1]:>8.4f} {rollouts / med[name]:>11.0f}")
    print(f"ratio echo2/trl (median): {med['echo2'] / med['trl']:.3f}")


if __name__ == "__main__":
    main()
