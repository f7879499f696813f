"""Map echo2's config onto TRL's ``GRPOConfig``: the one place learner settings meet TRL's names, and the checks
on how the learner was started (launcher, process count, micro-batches, precision) that must run before DeepSpeed
or TRL would fail with a less helpful message."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from trl import GRPOConfig

from echo2.learner.trl_fields import passthrough

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOW_PRECISION = ("bfloat16", "float16")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_launch(cfg: Any, world_size: int, env: Mapping[str, str] = os.environ) -> None:
    """Fail, saying what to run instead, where the learner cannot start as launched.

    * DeepSpeed without a launcher: ``deepspeed.init_distributed`` finds no RANK / WORLD_SIZE and falls back on MPI
      discovery, which fails with ``No module named 'mpi4py'``.
    * N processes must each take whole groups: N must divide P (``rollout.prompts_per_step``).
    """
    if cfg.learner.deepspeed is not None:
        missing = [k for k in LAUNCHER_ENV if k not in env]
        if missing:
            raise RuntimeError(
                f"learner.deepspeed is set but this process was not started by a launcher ({', '.join(missing)} "
                "unset; DeepSpeed would then look for MPI). Start it with `launchers/learner.sh N [overrides]` "
                "(N learner processes, e.g. one per GPU; N=1 is fine), or use learner=default for a single process "
                "without DeepSpeed.")
    p = cfg.rollout.prompts_per_step
    if p < 1 or p % world_size:
        raise ValueError(
            f"{world_size} learner processes with rollout.prompts_per_step={p}: every process trains on whole groups, "
            f"so the number of processes must divide P. Processes that would: {_divisors(p) if p > 0 else '-'}; "
            f"or set rollout.prompts_per_step to a multiple of {world_size}.")
    slice_rollouts = p // world_size * cfg.rollout.group_size
    mb = cfg.learner.micro_batch_size
    if mb is not None and (mb < 1 or slice_rollouts % mb):
        raise ValueError(
            f"learner.micro_batch_size={mb}: each of the {world_size} learner process(es) trains on "
            f"{slice_rollouts} rollouts per step (P*G/N), which must split into equal micro-batches. Values that "
            f"would: {_divisors(slice_rollouts)} (null: the whole slice at once).")
    check_precision(cfg)


def resolve_precision(cfg: Any, cuda: bool | None = None) -> None:
    """Settle the ``auto`` precision settings in place (the resolved config then records what ran):
    ``model.dtype=auto`` is bfloat16 where there are GPUs and float32 on CPU; ``learner.bf16=null`` follows the
    model's dtype (bf16 compute with fp32 master weights for a bf16/fp16 model, unless
    ``learner.low_precision_weights`` asks to train those weights directly), so that ``model=qwen3_0.6b`` alone
    trains in float32 on a CPU and in bf16 on a GPU."""
    from omegaconf import open_dict

    if cuda is None:
        cuda = torch.cuda.is_available()
    with open_dict(cfg):
        if cfg.model.dtype == "auto":
            cfg.model.dtype = "bfloat16" if cuda else "float32"
        if cfg.learner.bf16 is None:  # (low_precision_weights: the opt-in to train the bf16 weights themselves)
            cfg.learner.bf16 = cfg.model.dtype in LOW_PRECISION and not cfg.learner.low_precision_weights


def check_precision(cfg: Any) -> None:
    """AdamW on bf16/fp16 weights loses small updates: at lr 1e-6 an update below half an ulp of the weight (bf16
    keeps 8 significant bits) rounds away, so most weights never move. Refuse it unless the user opts in."""
    lc = cfg.learner
    if cfg.model.dtype in LOW_PRECISION and not lc.bf16 and not lc.low_precision_weights:
        raise ValueError(
            f"model.dtype={cfg.model.dtype} with learner.bf16=false would train {cfg.model.dtype} weights directly "
            "with AdamW, which rounds small updates away (at lr 1e-6 most of them). Set learner.bf16=true (fp32 "
            "master weights and optimizer state, bf16 compute; snapshots published in bf16), or model.dtype=float32; "
            "learner.low_precision_weights=true trains the low-precision weights anyway.")


def micro_batches(cfg: Any, world_size: int) -> tuple[int, int]:
    """(rollouts per forward/backward per process, micro-batches per optimizer step)."""
    slice_rollouts = cfg.rollout.prompts_per_step // world_size * cfg.rollout.group_size
    mb = cfg.learner.micro_batch_size or slice_rollouts
    return mb, slice_rollouts // mb


def master_dtype(cfg: Any) -> str:
    """The dtype the learner loads its weights in: float32 under learner.bf16 (bf16 is the compute dtype: autocast,
    or DeepSpeed's bf16 mode with fp32 master weights in the optimizer), else model.dtype. With a LoRA adapter
    (``learner.lora``) the base is frozen and needs no fp32 master copy: it stays in model.dtype, and the adapter it
    trains has float32 weights (PEFT's own cast with one process; DeepSpeed's master copy under ZeRO), as TRL loads a
    bf16 model for LoRA; the workers hold the same base."""
    return "float32" if cfg.learner.bf16 and cfg.learner.lora.rank is None else cfg.model.dtype


def peft_config(cfg: Any) -> Any:
    """``learner.lora`` as PEFT's LoraConfig for TRL's ``peft_config``, or None for full fine-tuning."""
    lora = cfg.learner.lora
    if lora.rank is None:
        return None
    from peft import LoraConfig

    targets = lora.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      use_rslora=lora.use_rslora, bias="none", task_type="CAUSAL_LM")


def learning_rate_warning(cfg: Any) -> str | None:
    """A warning when ``learner.learning_rate`` is far from what a pretrained model wants: 1e-6..1e-5 for full
    fine-tuning, about 10x that for a LoRA adapter (its update is a low-rank product that starts at zero)."""
    lr, lora = cfg.learner.learning_rate, cfg.learner.lora.rank is not None
    if cfg.model.path._target_.endswith("build_tiny"):  # trained from scratch: its rates are its own
        return None
    low, high = (3e-6, 1e-3) if lora else (0.0, 1e-4)
    if lr >= high:
        return (f"learner.learning_rate={lr:g} is a rate for the tiny model trained from scratch; a pretrained model "
                + ("with a LoRA adapter usually wants 1e-5..2e-4 (about 10x full fine-tuning's)" if lora else
                   "usually wants 1e-6..1e-5 (experiment=smollm2_arith uses 1e-5)"))
    if lr < low:
        return (f"learner.learning_rate={lr:g} with learner.lora: a LoRA adapter usually wants about 10x full "
                "fine-tuning's rate (1e-5..2e-4); at full fine-tuning's it learns slowly")
    return None


def grpo_kwargs(cfg: Any, run_dir: str | Path, world_size: int) -> dict[str, Any]:
    """The GRPOConfig fields echo2 sets from its own config: each is in trl_fields.OWNED, which names the echo2 key
    a ``learner.trl`` entry of the same name is refused for (tests/learner/test_trl_fields.py holds them equal)."""
    lc, rc = cfg.learner, cfg.rollout
    deepspeed = OmegaConf.to_container(lc.deepspeed, resolve=True) if lc.deepspeed else None
    micro, steps = micro_batches(cfg, world_size)
    return dict(
        output_dir=str(Path(run_dir) / "trainer"),
        seed=cfg.seed,
        max_steps=cfg.run.steps,
        # One optimizer step per R = P·G rollouts (per pass), split evenly over the learner processes, each slice in
        # `steps` micro-batches of `micro`: TRL buffers the slice and hands out one micro-batch per accumulation step
        # (steps_per_generation = gradient_accumulation_steps), so version == optimizer step; with num_iterations = μ
        # TRL reuses the buffered slice for μ optimizer steps before the next batch.
        per_device_train_batch_size=micro,
        num_generations=rc.group_size,
        gradient_accumulation_steps=steps,
        steps_per_generation=steps,
        num_iterations=lc.num_iterations,
        max_completion_length=cfg.task.max_completion_length,
        temperature=rc.temperature,  # the learner's logprobs must use the sampling temperature
        learning_rate=lc.learning_rate,
        lr_scheduler_type=lc.lr_scheduler_type,
        warmup_steps=lc.warmup_steps,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.max_grad_norm,
        loss_type=lc.loss_type,
        beta=lc.beta,
        epsilon=lc.epsilon,
        epsilon_high=lc.epsilon_high,
        scale_rewards=lc.scale_rewards,
        mask_truncated_completions=lc.mask_truncated_completions,
        bf16=lc.bf16,
        gradient_checkpointing=lc.gradient_checkpointing,
        deepspeed=deepspeed,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",  # echo2's MetricsSink writes every record to run.report_to, with namespaced keys
        run_name=cfg.run.name,
        save_strategy="steps" if cfg.run.save_every_steps else "no",
        save_steps=cfg.run.save_every_steps or 500,
        # HF's rotation runs before echo2's state completes a new checkpoint: with one kept, a kill then left none
        # complete. echo2 rotates instead, after (callbacks.SourceVersions, run.keep_checkpoints).
        save_total_limit=None,
        # The final model is pushed once, at the end (train.py: outputs.save_final), never per checkpoint, and no
        # repository is created while the trainer is built: push_to_hub stays off here; the repo settings are used.
        push_to_hub=False,
        hub_model_id=cfg.run.hub_model_id,
        hub_private_repo=cfg.run.hub_private,
        disable_tqdm=True,  # echo2's own progress bar
        log_completions=False,  # echo2's completions table (run.completions_every_steps)
    )


def grpo_config(cfg: Any, run_dir: str | Path, world_size: int) -> GRPOConfig:
    """echo2's settings (grpo_kwargs) and the ``learner.trl`` entries TRL's training path reads
    (trl_fields.passthrough; validate() refused the others)."""
    trl = OmegaConf.to_container(cfg.learner.trl, resolve=True) if cfg.learner.trl else {}
    owned = grpo_kwargs(cfg, run_dir, world_size)
    return GRPOConfig(**owned, **passthrough(trl, {"dtype": master_dtype(cfg)}))


def activation_gib(model_config: Any, tokens: int, seq_len: int, value_bytes: int,
                   checkpointing: bool) -> float | None:
    """About how much memory one forward/backward keeps for its backward, GiB: ``tokens`` tokens (a micro-batch's
    sequences times their length, ``seq_len``) through a decoder of ``model_config``'s shape (its text part, for a
    multimodal one); None for a shape this does not know (no hidden size or layer count). Per token and layer it
    counts 16 values per hidden unit and 6 per MLP unit, and with eager attention 2.5 per head and position (the
    scores it keeps): the form of Korthikanti et al. 2022's count ("Reducing Activation Recomputation in Large
    Transformer Models"), refitted to a gated MLP. On SmolLM2-135M in float32 with LoRA it reads 3.4, 6.8 and 17.1
    GiB where 4 x 300, 8 x 300 and 8 x 600 tokens peaked at 3.7, 6.9 and 14.7 GiB above the model with eager
    attention, and 2.5, 4.9 and 9.9 GiB where they peaked at 2.0, 5.6 and 10.7 GiB with SDPA. With activation
    checkpointing each layer keeps its input only, plus one layer's full count while it is recomputed (not
    measured)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    h, layers = getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None)
    if not (isinstance(h, int) and isinstance(layers, int)):
        return None
    inter = getattr(text, "intermediate_size", None) or 4 * h
    heads = getattr(text, "num_attention_heads", None) or 0
    eager = getattr(model_config, "_attn_implementation", None) == "eager"
    per_layer = 16 * h + 6 * inter + (2.5 * heads * seq_len if eager else 0)
    values = tokens * (layers * h + per_layer if checkpointing else layers * per_layer)
    return values * value_bytes / 2**30


def free_memory_gib(device: torch.device, processes_here: int = 1) -> float:
    """What one learner process may count on now: its GPU's free memory, or the host's available memory shared by
    the ``processes_here`` learner processes on it."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**30
    import psutil  # accelerate's dependency

    return psutil.virtual_memory().available / 2**30 / max(1, processes_here)


def longest_prompt(task: Any, tokenizer: Any, rows: Any, n: int = 64) -> int:
    """The longest prompt, in tokens, among the first ``n`` rows (an estimate's input, not a limit)."""
    return max((len(task.prompt_ids(tokenizer, rows[i])) for i in range(min(n, len(rows)))), default=0)


def micro_batch_advice(cfg: Any, world_size: int, model_config: Any, free_gib: float, prompt_tokens: int = 0,
                       trained_params: int = 0) -> str | None:
    """A warning when one micro-batch's activations would not fit in ``free_gib``, less what training has yet to
    allocate (the trained parameters' gradients and Adam's two moments in float32, split across processes under
    DeepSpeed), naming the micro-batch size that would; None when it fits or the model's shape is not known.
    Sequences are counted at ``prompt_tokens`` (the longest prompt seen) plus ``task.max_completion_length``. The
    count is rough: this warns before an out-of-memory kill, it does not promise there will be none."""
    slice_rollouts = cfg.rollout.prompts_per_step // world_size * cfg.rollout.group_size
    mb = cfg.learner.micro_batch_size or slice_rollouts
    seq_len = prompt_tokens + int(cfg.task.max_completion_length)
    value_bytes = 2 if cfg.learner.bf16 or cfg.model.dtype in LOW_PRECISION else 4
    checkpointing = bool(cfg.learner.gradient_checkpointing)
    free_gib -= trained_params * 12 / 2**30 / (world_size if cfg.learner.deepspeed else 1)

    def gib(n: int) -> float | None:
        return activation_gib(model_config, n * seq_len, seq_len, value_bytes, checkpointing)

    need = gib(mb)
    if need is None or need <= 0.8 * free_gib:
        return None
    fits = [d for d in _divisors(slice_rollouts) if gib(d) <= 0.5 * free_gib]
    what = ("learner.micro_batch_size=null: the step's whole slice at once" if cfg.learner.micro_batch_size is None
            else f"learner.micro_batch_size={mb}")
    ways = [f"learner.micro_batch_size={d} (TRL's per_device_train_batch_size; about {gib(d):.1f} GiB)"
            for d in fits[-1:]] + ([] if checkpointing else ["learner.gradient_checkpointing=true"])
    ways = ways or ["a shorter task.max_completion_length"]
    return (f"one forward/backward holds {mb} sequences of up to {seq_len} tokens ({what}): about {need:.1f} GiB of "
            f"activations by a rough count, against {max(free_gib, 0):.1f} GiB free on the learner's device for "
            f"them. If memory runs out, set {' or '.join(ways)}")
