"""Bytes per update: sparse delta (echo2/broadcast/delta.py) against the full snapshot, over a real training run.

Trains this project's learner (``python train.py``'s build, sync source, so no workers are needed) and keeps the
snapshot the broadcaster would publish after every step; then encodes version v against v - κ for κ in
``--kappa`` and reports delta bytes / full bytes per update, and checks every delta decodes to the exact
snapshot. Snapshots are shipped in the model's dtype (float32 here on CPU; bf16 on GPUs): ``--as-bf16`` also
reports what a bf16 snapshot of the same weights would cost (the weights cast, as a bf16 learner would hold).

    python benchmarks/delta_ratio.py                          # tiny model, copy task, 60 steps
    python benchmarks/delta_ratio.py --steps 100 --kappa 1 2 4 learner.learning_rate=1e-5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kappa", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import torch
    from transformers import TrainerCallback

    import train
    from echo2.broadcast import delta, snapshot
    from echo2.env import configure_process
    from step_time import compose

    configure_process()
    cfg = compose(["rollout=sync", f"run.steps={args.steps}", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0", *args.overrides])
    snaps: dict[str, list[bytes]] = {"float32": [], "bfloat16": []}

    class Keep(TrainerCallback):
        def on_step_end(self, a, state, control, model=None, **kw):
            sd = model.state_dict()
            snaps["float32"].append(snapshot.encode(sd))
            snaps["bfloat16"].append(snapshot.encode({k: v.to(torch.bfloat16) for k, v in sd.items()}))

    with tempfile.TemporaryDirectory() as tmp:
        trainer, source, _ = train.build(cfg, tmp, rank=0, world_size=1)
        trainer.add_callback(Keep())
        trainer.train()
        source.close()

    print(f"\nsparse delta vs full snapshot, model {cfg.model.name}, {args.steps} steps of arith-{cfg.task.level} "
          f"(lr {cfg.learner.learning_rate}); every delta decoded and compared bit for bit")
    print(f"{'dtype':<9} {'full bytes':>11} {'kappa':>5} {'delta/full median':>18} {'min':>6} {'max':>6} "
          f"{'changed words':>14}")
    for dtype, blobs in snaps.items():
        word = 4 if dtype == "float32" else 2
        for k in args.kappa:
            ratios, changed = [], []
            for v in range(k, len(blobs)):
                d = delta.encode(blobs[v], blobs[v - k], v - k, word_bytes=word)
                assert delta.apply(blobs[v - k], d) == blobs[v], "delta is not lossless"
                ratios.append(len(d) / len(blobs[v]))
                changed.append((len(d) - delta.HEADER.size) / (4 + word) / (len(blobs[v]) / word))
            print(f"{dtype:<9} {len(blobs[0]):>11} {k:>5} {statistics.median(ratios):>18.3f} {min(ratios):>6.3f} "
                  f"{max(ratios):>6.3f} {statistics.median(changed):>13.1%}")


if __name__ == "__main__":
    main()
