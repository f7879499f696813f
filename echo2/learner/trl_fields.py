"""TRL's ``GRPOConfig``, field by field, as echo2 treats it: the honest form of the ``learner.trl`` pass-through.

Every field of the installed ``GRPOConfig`` (TRL's own and the ``TrainingArguments`` it extends) is in exactly one
class, so a ``learner.trl.X`` setting is judged when the config is validated, before a model loads or a process
starts:

* **owned**: echo2 sets it from its own config (``OWNED`` maps it to the echo2 key); passing it is refused, naming
  that key (``learner.trl.num_generations`` -> ``rollout.group_size``).
* **refused**: read only by the parts of TRL that echo2 replaces (its generation, scoring, vLLM client, evaluation
  loop) or at odds with how echo2 trains; passing it is refused with the reason (``REFUSED``).
* **echo2's**: read by echo2 itself rather than by TRL (``reward_weights``: the task's reward functions are summed
  with them wherever rollouts are scored; ``generation_kwargs``: the keys that keep the sampling distribution the
  one the learner scores reach every engine, the others are refused with why).
* **passed**: read by TRL's training path, which echo2 keeps (optimizer, loss variants, entropy terms...): handed to
  ``GRPOConfig`` as they are (``PASSED``); ``model_init_kwargs`` is merged with echo2's dtype.

``loss_type`` and ``importance_sampling_level`` are checked against the values TRL's ``_compute_loss`` handles, read
from its source, so a TRL upgrade brings its new names along. ``tests/learner/test_trl_fields.py`` fails when a TRL
upgrade adds a field no class above holds.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any

# ----------------------------------------------------------------------------------------------- owned by echo2
# GRPOConfig field -> the echo2 setting that decides it (learner/args.py:grpo_config sets each one it passes).
OWNED: dict[str, str] = {
    "output_dir": "hydra.run.dir (TRL's output_dir is <run dir>/trainer)",
    "per_device_train_batch_size": "learner.micro_batch_size",
    "gradient_accumulation_steps": "learner.micro_batch_size",
    "steps_per_generation": "learner.micro_batch_size",
    "generation_batch_size": "rollout.prompts_per_step",
    "num_generations": "rollout.group_size",
    "num_iterations": "learner.num_iterations",
    "max_steps": "run.steps",
    "num_train_epochs": "run.steps",
    "max_completion_length": "task.max_completion_length",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "learning_rate": "learner.learning_rate",
    "lr_scheduler_type": "learner.lr_scheduler_type",
    "warmup_steps": "learner.warmup_steps",
    "weight_decay": "learner.weight_decay",
    "max_grad_norm": "learner.max_grad_norm",
    "loss_type": "learner.loss_type",
    "beta": "learner.beta",
    "epsilon": "learner.epsilon",
    "epsilon_high": "learner.epsilon_high",
    "scale_rewards": "learner.scale_rewards",
    "mask_truncated_completions": "learner.mask_truncated_completions",
    "bf16": "learner.bf16",
    "gradient_checkpointing": "learner.gradient_checkpointing",
    "deepspeed": "learner.deepspeed (learner=zero2, learner=zero3)",
    "use_cpu": "the machine (the learner uses CUDA where torch sees it)",
    "local_rank": "the launcher (launchers/learner.sh)",
    "seed": "seed",
    "data_seed": "seed",
    "logging_steps": "run (one record per optimizer step: metrics.jsonl and run.report_to)",
    "logging_strategy": "run (one record per optimizer step: metrics.jsonl and run.report_to)",
    "logging_first_step": "run (one record per optimizer step: metrics.jsonl and run.report_to)",
    "logging_nan_inf_filter": "run (one record per optimizer step: metrics.jsonl and run.report_to)",
    "include_num_input_tokens_seen": "run (rollout/tokens is logged every step)",
    "report_to": "run.report_to",
    "run_name": "run.name",
    "project": "run.project",
    "disable_tqdm": "run.progress",
    "save_strategy": "run.save_every_steps",
    "save_steps": "run.save_every_steps",
    "save_total_limit": "run.keep_checkpoints",
    "resume_from_checkpoint": "run.resume",
    "eval_strategy": "run.eval_every_steps",
    "eval_steps": "run.eval_every_steps",
    "push_to_hub": "run.push_to_hub",
    "hub_model_id": "run.hub_model_id",
    "hub_private_repo": "run.hub_private",
    "hub_token": "the HF_TOKEN environment variable, or `hf auth login` (a token never goes in a config)",
    "log_completions": "run.completions_every_steps",
    "num_completions_to_print": "run.completions_rows",
    "vllm_importance_sampling_correction": "rollout.correction (tis, mask, icepop, m2po, seq_mask)",
    "vllm_importance_sampling_mode": "rollout.correction (tis, mask, icepop, m2po, seq_mask)",
    "vllm_importance_sampling_clip_max": "rollout.is_max",
    "vllm_importance_sampling_clip_min": "rollout.is_min",
    "vllm_importance_sampling_cap": "rollout.is_max",
}

# ---------------------------------------------------------------------------------------------- refused, with why
_GENERATION = ("generation runs on echo2's engines (the workers' vLLM, or transformers for rollout=sync), not in "
               "TRL's generate")
_RESHAPES = ("it reshapes the sampling distribution, so the engines' behaviour logprobs would no longer be the "
             "softmax at rollout.temperature that the learner scores (every importance ratio biased); lower "
             "rollout.temperature to sharpen sampling")
_VLLM = ("echo2's workers run vLLM themselves (pool.engine, pool.vllm_args, launchers/join.sh); TRL's vLLM client "
         "is not used")
_EVAL = ("evaluation is echo2's: run.eval_every_steps (greedy accuracy on the task's held-out split) and "
         "`python -m echo2.eval CHECKPOINT task=...` (pass@k)")
_LOGS = "echo2 writes its own logs (metrics.jsonl, completions.jsonl and run.report_to)"
_RESUME = "echo2's checkpoints are for resuming the whole run (run.resume): weights, optimizer, RNG, data position"
_HUB = "echo2 pushes the final model once, at the end of the run (run.push_to_hub)"

REFUSED: dict[str, str] = {
    **dict.fromkeys(("min_p", "repetition_penalty"), _RESHAPES),
    **dict.fromkeys(("cache_implementation", "use_transformers_continuous_batching",
                     "transformers_continuous_batching_config", "use_transformers_paged"), _GENERATION),
    "chat_template_kwargs": "the task encodes its prompts (echo2.scoring.encode_prompt), not TRL",
    "max_tool_calling_iterations": "TRL's tool loop lives in its generation, which echo2 replaces; multi-turn "
                                   "episodes are the task's environment",
    "multi_objective_aggregation": "echo2 sums the weighted rewards and then normalises them (TRL's default, "
                                   "sum_then_normalize); normalize_then_sum is not implemented",
    "trust_remote_code": "the model is loaded by the learner, the coordinator's tokenizer and every worker's engine; "
                         "models that ship their own code are not supported",
    "fp16": "fp16 mixed precision is not supported: learner.bf16 (bf16 compute, fp32 master weights)",
    "use_liger_kernel": "TRL's Liger GRPO loss bypasses _compute_loss, where echo2's correction weights and "
                        "micro-batch normalisation apply",
    "liger_kernel_config": "TRL's Liger GRPO loss bypasses _compute_loss, where echo2's correction weights and "
                           "micro-batch normalisation apply",
    "neftune_noise_alpha": "noise in the learner's embeddings would make its logprobs differ from the engines'",
    "label_smoothing_factor": "the GRPO loss has no labels",
    "label_names": "the GRPO loss has no labels",
    "average_tokens_across_devices": "the GRPO loss normalises itself (learner.loss_type)",
    "auto_find_batch_size": "TRL refuses it too: set learner.micro_batch_size",
    "remove_unused_columns": "the reward functions read the task's columns, which echo2 keeps",
    "train_sampling_strategy": "TRL's RepeatSampler orders the prompts (seed)",
    "length_column_name": "TRL's RepeatSampler orders the prompts (seed)",
    "accelerator_config": "the learner's data path (whole groups per process) relies on accelerate's defaults",
    "parallelism_config": "context and tensor parallelism are not supported; shard with learner.deepspeed",
    "fsdp": "FSDP is not supported: the learner shards with DeepSpeed (learner=zero2, learner=zero3)",
    "fsdp_config": "FSDP is not supported: the learner shards with DeepSpeed (learner=zero2, learner=zero3)",
    "save_only_model": _RESUME,
    "ignore_data_skip": _RESUME,
    "restore_callback_states_from_checkpoint": _RESUME,
    "enable_jit_checkpoint": "echo2 handles SIGTERM itself: the run ends after the current step, with a checkpoint",
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "log_multimodal": _LOGS,
    "log_unique_prompts": _LOGS,
    "log_completions_hub_repo": _LOGS,
    **dict.fromkeys(("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
                    "echo2 logs to a local trackio project (run.project); sync it with trackio's own tools"),
    **dict.fromkeys(("eval_delay", "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start",
                     "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
                     "include_for_metrics", "batch_eval_metrics", "do_eval", "do_predict", "bf16_full_eval",
                     "fp16_full_eval", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
                     "num_generations_eval"), _EVAL),
}
REFUSED_PREFIXES: dict[str, str] = {"vllm_": _VLLM, "use_vllm": _VLLM}

# ------------------------------------------------------------------------------------------------- echo2 reads
ECHO2_READS: dict[str, str] = {
    "reward_weights": "weights of the task's reward functions, in their order (summed wherever rollouts are scored)",
    "generation_kwargs": "sampling settings for every engine, where they keep the learner's policy exact",
}

# ------------------------------------------------------------------------------------------ passed to GRPOConfig
PASSED: frozenset[str] = frozenset({
    # the optimizer and its schedule
    "optim", "optim_args", "optim_target_modules", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_kwargs",
    # loss variants and terms TRL's _compute_loss reads
    "delta", "importance_sampling_level", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile", "entropy_coef",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "off_policy_mask_threshold", "use_bias_correction_kl", "router_aux_loss_coef",
    # the reference model (learner.beta > 0)
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    # the model in training
    "model_init_kwargs", "disable_dropout", "cast_lm_head_to_fp32", "gradient_checkpointing_kwargs", "use_cache",
    "torch_compile", "torch_compile_backend", "torch_compile_mode", "tf32", "torch_empty_cache_steps",
    "ds3_gather_for_generation", "pad_to_multiple_of", "full_determinism",
    # the prompt rows' loader (TRL's sampler hands each step its prompts)
    "shuffle_dataset", "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "dataloader_in_order",
    # distributed plumbing accelerate reads
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend",
    "ddp_timeout", "save_on_each_node", "log_on_each_node",
    # the hub push (run.push_to_hub) and logging verbosity
    "hub_revision", "log_level", "log_level_replica",
    # inert in echo2's use (read by nothing that runs, or only by HF's own bookkeeping)
    "debug", "skip_memory_metrics", "do_train",
})

# keys of model_init_kwargs echo2 decides: merged otherwise (e.g. attn_implementation)
MODEL_INIT_OWNED = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "device_map": "the launcher (one device "
                    "per learner process)", "revision": "model.path (the model and tokenizer are loaded from it)",
                    "trust_remote_code": REFUSED["trust_remote_code"]}

# generation_kwargs (TRL: GenerationConfig for transformers, SamplingParams for vLLM), key by key
GENERATION_KEEPS = {"stop_token_ids": "more stop tokens", "eos_token_id": "more stop tokens"}
GENERATION_OWNED = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
                    "max_tokens": "task.max_completion_length", "max_new_tokens": "task.max_completion_length",
                    "n": "rollout.group_size", "num_return_sequences": "rollout.group_size",
                    "logprobs": "every engine (behaviour logprobs are always returned)",
                    "do_sample": "every engine (sampling for rollouts, greedy for evaluation)",
                    "seed": "seed (each engine is seeded; a per-request seed would repeat the same samples)"}
GENERATION_RESHAPES = {"min_p", "typical_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                       "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                       "min_tokens", "min_new_tokens", "min_length", "logit_bias", "allowed_token_ids",
                       "epsilon_cutoff", "eta_cutoff", "guided_decoding", "structured_outputs", "length_penalty",
                       "exponential_decay_length_penalty", "sequence_bias", "renormalize_logits", "ignore_eos",
                       "forced_bos_token_id", "forced_eos_token_id", "encoder_repetition_penalty", "bad_words",
                       "top_n_sigma", "diversity_penalty", "num_beams", "penalty_alpha", "guidance_scale",
                       "watermarking_config", "stop", "include_stop_str_in_output"}


@functools.cache
def grpo_fields() -> dict[str, dataclasses.Field]:
    from trl import GRPOConfig

    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def classify(name: str) -> tuple[str, str]:
    """``(class, detail)`` of a GRPOConfig field: ``owned`` (the echo2 key), ``refused`` (why), ``echo2`` (what
    echo2 does with it), ``passed`` (""), or ``unknown`` ("": not a GRPOConfig field)."""
    if name in OWNED:
        return "owned", OWNED[name]
    if name in REFUSED:
        return "refused", REFUSED[name]
    for prefix, why in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            return "refused", why
    if name in ECHO2_READS:
        return "echo2", ECHO2_READS[name]
    if name in PASSED:
        return "passed", ""
    return "unknown", ""


def unclassified() -> list[str]:
    """GRPOConfig fields no class holds (a TRL upgrade added them), and classified names GRPOConfig lacks."""
    fields = set(grpo_fields())
    named = set(OWNED) | set(REFUSED) | set(ECHO2_READS) | PASSED
    return sorted(n for n in fields if classify(n)[0] == "unknown") + sorted(f"{n} (gone)" for n in named - fields)


# ------------------------------------------------------------------------------ values TRL's loss accepts


def _handled(module: str, cls: str, method: str, attribute: str) -> tuple[str, ...]:
    """The string values of ``self.<attribute>`` that ``cls.method`` (in TRL's ``module``) handles: each if/elif
    chain on the attribute that ends in ``else: raise`` lists what it takes; a value must be taken by every such
    chain. Read from the source file, without importing TRL (whose import starts vLLM's platform probes)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("trl")
    path = Path(spec.submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text(), str(path))
    body = next((m for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls for m in c.body
                 if isinstance(m, ast.FunctionDef) and m.name == method), None)
    if body is None:
        raise RuntimeError(f"no {cls}.{method} in {path}: TRL changed; read its source and update "
                           "echo2/learner/trl_fields.py")
    chains: list[set[str]] = []
    inner: set[int] = set()
    for node in ast.walk(body):
        if not isinstance(node, ast.If) or id(node) in inner:
            continue
        values, exhaustive, link = set(), False, node
        while True:
            values |= _compared(link.test, attribute)
            if len(link.orelse) == 1 and isinstance(link.orelse[0], ast.If):
                link = link.orelse[0]
                inner.add(id(link))
                continue
            exhaustive = any(isinstance(n, ast.Raise) for n in link.orelse)
            break
        if values and exhaustive:
            chains.append(values)
    if not chains:
        raise RuntimeError(f"no if/elif chain on self.{attribute} in {cls}.{method}: TRL changed; read its source "
                           "and update echo2/learner/trl_fields.py")
    return tuple(sorted(set.intersection(*chains)))


def _compared(test: ast.AST, attribute: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(test):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == attribute
                and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.In))):
            right = node.comparators[0]
            items = right.elts if isinstance(right, (ast.List, ast.Tuple, ast.Set)) else [right]
            out |= {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


@functools.cache
def loss_types() -> tuple[str, ...]:
    """The ``loss_type`` values TRL's GRPO loss computes (read from ``GRPOTrainer._compute_loss``)."""
    return _handled("trl.trainer.grpo_trainer", "GRPOTrainer", "_compute_loss", "loss_type")


@functools.cache
def importance_sampling_levels() -> tuple[str, ...]:
    """The ``importance_sampling_level`` values TRL's GRPO loss computes."""
    return _handled("trl.trainer.grpo_trainer", "GRPOTrainer", "_compute_loss", "importance_sampling_level")


# ------------------------------------------------------------------------------------------------- checks


def hint(name: str) -> str | None:
    """For a key echo2 does not have whose last part is a GRPOConfig field: where that setting lives in echo2 (or
    why it does not), for "no such option" messages. None if ``name`` is no GRPOConfig field."""
    kind, detail = classify(name)
    if kind == "owned":
        return f"TRL's {name} is {detail} in echo2"
    if kind == "refused":
        return f"TRL's {name} is not used by echo2: {detail}"
    if kind in ("passed", "echo2"):
        return f"TRL's {name} is set as learner.trl.{name}"
    return None


def check(trl: Mapping[str, Any]) -> list[str]:
    """The errors of ``learner.trl``'s entries (empty: all good). Values are checked where echo2 or TRL would
    otherwise fail late: ``importance_sampling_level``, ``reward_weights``, ``generation_kwargs``,
    ``model_init_kwargs``."""
    errors = []
    for name, value in trl.items():
        kind, detail = classify(name)
        key = f"learner.trl.{name}"
        if kind == "owned":
            errors.append(f"{key}: echo2 sets {name} itself; use {detail}")
        elif kind == "refused":
            errors.append(f"{key}: not used by echo2: {detail}")
        elif kind == "unknown":
            near = difflib.get_close_matches(name, list(grpo_fields()), n=1)
            errors.append(f"{key}: not a field of TRL's GRPOConfig" + (f" (did you mean learner.trl.{near[0]}?)"
                                                                           if near else ""))
    level = trl.get("importance_sampling_level")
    if level is not None and level not in importance_sampling_levels():
        errors.append(f"learner.trl.importance_sampling_level={level!r}: TRL takes "
                      f"{', '.join(importance_sampling_levels())}")
    weights = trl.get("reward_weights")
    if weights is not None and (not isinstance(weights, (list, tuple)) or not weights
                                or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
        errors.append(f"learner.trl.reward_weights={weights!r}: a list of numbers, one per reward function of the task")
    errors += generation_errors(trl.get("generation_kwargs"))
    init = trl.get("model_init_kwargs")
    if init is not None:
        if not isinstance(init, Mapping):
            errors.append(f"learner.trl.model_init_kwargs={init!r}: a mapping of from_pretrained keyword arguments")
        else:
            errors += [f"learner.trl.model_init_kwargs.{k}: echo2 decides it: {why}"
                       for k, why in MODEL_INIT_OWNED.items() if k in init]
    return errors


def generation_errors(kwargs: Any) -> list[str]:
    """Why each key of ``generation_kwargs`` cannot be honoured (empty: every key reaches every engine)."""
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return [f"learner.trl.generation_kwargs={kwargs!r}: a mapping of sampling settings"]
    errors = []
    for k, v in kwargs.items():
        key = f"learner.trl.generation_kwargs.{k}"
        if k in GENERATION_KEEPS:
            ids = [v] if isinstance(v, int) and not isinstance(v, bool) else v
            if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and i >= 0 for i in ids):
                errors.append(f"{key}={v!r}: token ids (an id or a list of ids)")
        elif k in GENERATION_OWNED:
            errors.append(f"{key}: echo2 sets it from {GENERATION_OWNED[k]}")
        elif k in GENERATION_RESHAPES:
            errors.append(f"{key}: not supported: {_RESHAPES}")
        else:
            errors.append(f"{key}: not a sampling setting echo2 knows to keep the learner's policy exact (the "
                          f"engines take {', '.join(GENERATION_KEEPS)} from generation_kwargs)")
    return errors


def extra_stop_ids(trl: Mapping[str, Any]) -> list[int]:
    """The stop tokens ``generation_kwargs`` adds to the run's (every engine ends a completion at them)."""
    out: list[int] = []
    for k in GENERATION_KEEPS:
        v = (trl.get("generation_kwargs") or {}).get(k)
        if v is not None:
            out += [v] if isinstance(v, int) else list(v)
    return out


def passthrough(trl: Mapping[str, Any], model_init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``learner.trl`` entries handed to GRPOConfig (``check`` must have passed): the passed fields as they
    are, ``model_init_kwargs`` merged into echo2's own (``model_init_kwargs``)."""
    out = {k: v for k, v in trl.items() if classify(k)[0] == "passed"}
    out["model_init_kwargs"] = {**dict(out.get("model_init_kwargs") or {}), **model_init_kwargs}
    return out


def markdown() -> str:
    """The field table of docs/trl.md (``python -m echo2.learner.trl_fields``): every GRPOConfig field of the
    installed TRL, what echo2 does with it, grouped by class."""
    groups: dict[str, list[str]] = {"owned": [], "echo2": [], "passed": [], "refused": []}
    for name in sorted(grpo_fields()):
        kind, detail = classify(name)
        groups[kind].append(f"| `{name}` | {detail.replace('|', '/')} |" if detail else f"`{name}`")
    return "\n".join([
        "### Set by echo2 (refused in `learner.trl`, naming the echo2 key)", "", "| GRPOConfig field | echo2 |",
        "|---|---|", *groups["owned"], "",
        "### Read by echo2 itself", "", "| GRPOConfig field | what echo2 does with it |", "|---|---|",
        *groups["echo2"], "",
        "### Passed to TRL as they are (`+learner.trl.FIELD=VALUE`)", "", ", ".join(groups["passed"]), "",
        "### Refused, with the reason", "", "| GRPOConfig field | why |", "|---|---|", *groups["refused"], ""])


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m echo2.learner.trl_fields",
                            description="Print docs/trl.md's field-by-field section for the installed TRL: every "
                                        "GRPOConfig field, set by echo2, read by echo2, passed to TRL or refused.").parse_args()
    print(markdown(), end="")
