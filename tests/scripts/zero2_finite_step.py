"""Run by tests/learner/test_finite_steps.py under torchrun with 2 processes: the sync learner under DeepSpeed ZeRO-2
(gloo), 2 steps. Step 1: rank 0's batch carries a behaviour logprob of -1000 (bounded: every weight stays finite).
Step 2: rank 0's gradient alone is made NaN: the skip must be decided alike on both ranks (DeepSpeed's overflow check
reduces over the data-parallel group), so neither applies it. Rank 0 writes what it saw to OUT_DIR/result.json."""

import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "learner")]


def main(out_dir: str) -> None:
    import train
    from conftest import compose
    from test_finite_steps import Forged, weights
    from transformers import TrainerCallback

    from echo2.metrics import ROLLOUT_BOUNDED_TOKENS, TRAIN_SKIPPED_STEPS

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = compose(["rollout=sync", "learner=zero2", "run.steps=2", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0", "run.save_every_steps=0"])
    trainer, source, _ = train.build(cfg, str(Path(out_dir) / "run"), rank=rank, world_size=world)
    if rank == 0:
        trainer.rollout_source = Forged(source, -1000.0)
    seen: dict = {}

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and rank == 0:
                seen["hook"] = next(trainer.model.parameters()).register_hook(lambda g: g * math.nan)

        def on_step_end(self, args, state, control, **kwargs):
            seen[state.global_step] = weights(trainer)

    trainer.add_callback(Steps())
    before = weights(trainer)
    trainer.train()
    records = [{k: h.get(k) for k in (TRAIN_SKIPPED_STEPS, ROLLOUT_BOUNDED_TOKENS)}
               for h in trainer.state.log_history if TRAIN_SKIPPED_STEPS in h]
    result = {"backend": trainer.backend(), "records": records,
              "step1_finite": bool(torch.isfinite(seen[1]).all()), "step1_moved": not torch.equal(seen[1], before),
              "step2_unchanged": torch.equal(seen[2], seen[1]), "step2_finite": bool(torch.isfinite(seen[2]).all())}
    (Path(out_dir) / f"result{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()  # as train.py ends with several processes


if __name__ == "__main__":
    main(sys.argv[1])
