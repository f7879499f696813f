"""Where a learner step's time goes on this CPU: a LoRA adapter against full fine-tuning, SDPA against eager attention.

The learner is built as ``train.py`` builds it (``--experiment``, default ``smollm2_arith``; the LoRA variants add
``experiment=smollm2_arith_lora``'s rank 8 and 1e-4; bf16 autocast with fp32 master weights, one thread), with the
sync source; its first batch is generated once and then trained on at every step (the source replays it), so a step
here is only the learner's own work: TRL's loss (its fused, chunked LM head), PEFT's layers, the backward, gradient
clipping and HF's optimizer. Each step is split into forward
(``compute_loss``), backward (``accelerator.backward``) and the rest (optimizer step, clipping, bookkeeping).
Variants alternate round by round, each round a fresh learner, so that the machine's drift spreads over all of
them; the first ``--warmup`` steps of each round are not counted.

    python benchmarks/lora_step.py                          # smollm2_arith's batch: 16 sequences of ~57 tokens
    python benchmarks/lora_step.py --experiment smollm2_poker --json out.json     # poker's (~110 tokens)
    python benchmarks/lora_step.py --variants full/eager lora/eager lora32/eager -- model.dtype=bfloat16
    python benchmarks/lora_step.py --variants full/eager/every full/eager lora/eager/every lora/eager
    python benchmarks/lora_step.py --variants full/eager lora/eager/cast lora/eager

A variant is ``TRAINING/ATTENTION[/every][/cast]``: ``/every`` has TRL's fused LM head score every position of the
padded batch, as TRL does on the CPU (echo2's learner scores only the completion tokens:
``score_completions_only_on_cpu``); ``/cast`` has PEFT cast each LoRA layer's input to the adapter's dtype also under
autocast, as PEFT does (echo2's learner skips it there: ``adapter_inputs_uncast_under_autocast``).

The probe (the policy's logprobs of 33 fixed tokens, computed at every publish) is timed after each round.

Run it pinned to one core (``taskset -c 0``), as the real-model benchmark pins its learner.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import echo2.learner.args as learner_args  # noqa: E402

LOADS_IN = learner_args.master_dtype
ATTENTION = {"sdpa": [], "eager": ["+learner.trl.model_init_kwargs={attn_implementation:eager}"]}
LORA = {"full": [], "lora": ["learner.lora.rank=8", "learner.learning_rate=1e-4"]}
# lora32: the adapter on a float32 copy of the base, as every learner.bf16 LoRA learner loaded it before its frozen
# base stayed in model.dtype (with model.dtype=bfloat16 the two differ; with float32 they are the same)
LORA["lora32"] = LORA["lora"]


def one_round(experiment: str, lora: str, attention: str, steps: int, warmup: int, extra: list[str],
              every_position: bool = False, peft_cast: bool = False) -> dict:
    """A fresh learner for one variant: per-step seconds of forward, backward and the rest, after ``warmup``.
    ``every_position``: TRL's fused LM head scores every position of the padded batch, as TRL does on the CPU, not
    only the completion tokens, as echo2's learner has it do (``score_completions_only_on_cpu``).
    ``peft_cast``: PEFT casts each LoRA layer's input to the adapter's dtype under autocast too, as PEFT does, where
    echo2's learner skips that cast (``adapter_inputs_uncast_under_autocast``)."""
    import echo2.learner.trainer as learner_trainer
    import train
    import trl.trainer.utils as trl_utils
    from step_time import compose
    from transformers import TrainerCallback

    cfg = compose([f"experiment={experiment}", "rollout=sync", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0", "run.save_every_steps=0", f"run.steps={steps}", "learner.bf16=true",
                   *LORA[lora], *ATTENTION[attention], *extra])
    learner_args.master_dtype = (lambda cfg: "float32") if lora == "lora32" else LOADS_IN
    uncast = learner_trainer.adapter_inputs_uncast_under_autocast
    if peft_cast:
        learner_trainer.adapter_inputs_uncast_under_autocast = lambda model: 0
    try:
        trainer, _, _ = train.build(cfg, f"/tmp/echo2-lora-step-{lora}-{attention}", rank=0, world_size=1)
    finally:
        learner_trainer.adapter_inputs_uncast_under_autocast = uncast
    compact = trl_utils._use_triton  # echo2's decision, set by the learner
    if every_position:
        trl_utils._use_triton = compact.trl_decides  # TRL's own
    first: list = []
    collect = trainer._collect

    def replay(rows):  # generate the first batch once; every later step trains on it again
        if not first:
            first.append(collect(rows))
        return first[0]

    parts = {"forward": 0.0, "backward": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    trainer._collect = replay
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    rows: list[dict] = []

    class Split(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            parts.update(forward=0.0, backward=0.0, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - parts["t0"]
            if state.global_step == 1:  # step 1 generated the batch: not a training step's cost
                return
            rows.append({"step": total, "forward": parts["forward"], "backward": parts["backward"],
                         "rest": total - parts["forward"] - parts["backward"]})

    trainer.add_callback(Split())
    trainer.train()
    from echo2.models.probe import probe_tokens
    w, ids = trainer.weights(), probe_tokens(len(trainer.processing_class))
    probe_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        w.probe_logprobs(ids)
        probe_s.append(time.perf_counter() - t0)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    kept = rows[warmup:]
    out = {k: statistics.median(r[k] for r in kept) for k in ("step", "forward", "backward", "rest")}
    out["trained_params"] = trained
    out["probe"] = statistics.median(probe_s)
    out["tokens"] = int(sum(len(r.prompt_ids) + len(r.completion.token_ids) for g in first[0] for r in g.rollouts))
    trl_utils._use_triton = compact
    del trainer
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="smollm2_arith")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="learner steps per round (the first generates the batch)")
    p.add_argument("--warmup", type=int, default=2, help="training steps of each round not counted")
    p.add_argument("--variants", nargs="+", default=["full/sdpa", "lora/sdpa", "full/eager", "lora/eager"])
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant (after --)")
    a = p.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            lora, attention, *flags = v.split("/")
            if set(flags) - {"every", "cast"}:
                p.error(f"variant {v}: expected TRAINING/ATTENTION[/every][/cast]")
            res = one_round(a.experiment, lora, attention, a.steps, a.warmup, a.overrides,
                            every_position="every" in flags, peft_cast="cast" in flags)
            results[v].append(res)
            print(f"round {r + 1} {v}: step {res['step']:.3f} s (forward {res['forward']:.3f}, backward "
                  f"{res['backward']:.3f}, rest {res['rest']:.3f}, probe {res['probe']:.3f}), {res['tokens']} tokens", flush=True)
    base = statistics.median(x["step"] for x in results[a.variants[0]])
    print(f"\n{a.experiment}: median over {a.rounds} rounds of each round's median step\n")
    print("| variant | trained parameters | step s | forward s | backward s | rest s | step / "
          f"{a.variants[0]} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for v, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("step", "forward", "backward", "rest")}
        summary[v] = {**med, "rounds": rs}
        print(f"| {v} | {rs[0]['trained_params']:,} | {med['step']:.3f} | {med['forward']:.3f} | "
              f"{med['backward']:.3f} | {med['rest']:.3f} | {med['step'] / base:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"experiment": a.experiment, "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
