"""The learner: TRL's GRPOTrainer, fed by a rollout source instead of its own generation.

How it differs from TRL's trainer (trl==1.16.0), and nothing else:

* ``_generate_and_score_completions`` is replaced. TRL's sampler still hands each step its prompt rows
  (each repeated G times); the learner passes one row per group to ``RolloutSource.collect`` and builds
  TRL's batch dict from the returned, already scored, groups.
* The "old" policy of GRPO's clipped ratio is the **behaviour** logprobs the engine returned with each
  token (``old_per_token_logps``). TRL instead recomputes them with the current weights or assumes
  ratio 1; with stale rollouts that would silently treat them as on-policy. With ``rollout.correction`` set,
  the learner uses the decoupled loss instead: the ratio is taken against its weights now (one more forward
  pass, without grad) and each token's advantage is weighted by π_learner / π_behaviour, truncated or masked
  as ``echo2/learner/corrections.py`` defines (tis, mask, icepop, m2po, seq_mask).
* One optimizer step per pass over a batch of R = P·G rollouts, so the policy version is exactly
  ``state.global_step`` (docs/design.md §1). Each process's slice of R/N rollouts may be split into micro-batches
  (``learner.micro_batch_size``): TRL's own buffering does it (``steps_per_generation =
  gradient_accumulation_steps = k``). TRL's grpo, dr_grpo and dapo normalisations then equal the whole slice's;
  bnpo's (per micro-batch token count) is rescaled here to the slice's token count, so the step does not depend on
  the micro-batch size.
* ``learner.num_iterations`` = μ > 1 is TRL's: μ optimizer steps (passes) over each batch, TRL's buffer reused, so a
  batch taken at version t trains versions t+1 .. t+μ and the next batch is taken at t+μ. What this module builds
  once per batch is kept for its μ passes: the "old" logprobs of the clip (the behaviour logprobs, or with a
  correction the learner's weights at the first pass, π_θold, computed once) and the correction's importance
  weights π_θold / π_behaviour, as TRL keeps ``old_per_token_logps`` and its vLLM importance-sampling ratio.
* With ``beta > 0`` the reference logprobs (TRL's frozen ``ref_model``, sharded like the policy under ZeRO-3)
  are computed here, once per slice, for TRL's KL term. With a LoRA adapter (``learner.lora``, TRL's
  ``peft_config``) the reference is the base model with the adapter disabled, as TRL does: no second copy.
* A LoRA policy publishes only its adapter (``weights``; echo2/broadcast/adapter.py).
* What a worker claims is bounded before it is used: a behaviour logprob more than ``rollout.max_log_ratio`` nats
  from the learner's is clamped to that distance (corrections.bound_log_ratio), where the learner's logprob is
  first computed: in ``_decoupled`` with a correction, else inside TRL's loss, between its forward pass and its
  ratio (``_get_per_token_logps_and_entropies``; no extra forward pass). Counted: ``rollout/bounded_tokens``.
* On the CPU, TRL's fused LM head scores only the completion tokens, as it does on CUDA, not every position of the
  padded batch (``score_completions_only_on_cpu``: the same values, a 1.4-1.65x faster step on SmolLM2-135M).
* A LoRA layer's input is not cast to the adapter's dtype where autocast casts it anyway (PEFT's own switch,
  ``adapter_inputs_uncast_under_autocast``: the same values; a bf16 base with a float32 adapter skips two copies of
  every adapted layer's input each way).
* A step whose loss (any process's) or gradient norm is not finite is skipped: no optimizer update, no weight or
  optimizer state changed, a warning, ``train/skipped_steps``. The version still advances (global_step), with the
  previous version's weights. Under DeepSpeed the engine steps inside backward and skips a step with a
  non-finite global gradient norm itself (its overflow check, all-reduced over the data-parallel group, so every
  rank decides alike); the learner counts and says it.

The loss itself (``_compute_loss``: every TRL ``loss_type``, clipping, KL, entropy terms) is TRL's.
``tests/learner/test_trl_contract.py`` fails if a TRL method overridden or called here changes signature.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from typing import Any

import torch
from transformers.trainer_callback import PrinterCallback
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import nanstd, pad, use_adapter

from echo2.broadcast.adapter import AdapterSpec
from echo2.learner.corrections import SCALE_REWARDS, Correction, bound_log_ratio, importance_weights, m2po_keep
from echo2.learner.past_policies import PastPolicies
from echo2.learner.reward_logs import log_episodes, log_reward_logs
from echo2.learner.speedups import adapter_inputs_uncast_under_autocast, score_completions_only_on_cpu
from echo2.learner.weights import PolicyWeights
from echo2.metrics import (BUFFER_STALENESS_MAX, BUFFER_STALENESS_MEAN, REWARD_FRAC_ZERO_STD_GROUPS,
                           REWARD_FUNCTION_PREFIX, REWARD_MEAN, REWARD_STD, ROLLOUT_BOUNDED_TOKENS,
                           ROLLOUT_COMPLETION_LEN_MAX, ROLLOUT_COMPLETION_LEN_MEAN, ROLLOUT_COMPLETION_LEN_MIN,
                           ROLLOUT_CONSUMED, ROLLOUT_IS_FRAC_CORRECTED, ROLLOUT_IS_FRAC_MASKED, ROLLOUT_IS_FRAC_TRUNCATED,
                           ROLLOUT_IS_LOG_RATIO_M2, ROLLOUT_IS_LOG_RATIO_M2_KEPT, ROLLOUT_IS_RATIO_MAX,
                           ROLLOUT_IS_RATIO_MEAN, ROLLOUT_IS_WEIGHT_MEAN, ROLLOUT_TOKENS, ROLLOUT_TOKENS_TOTAL,
                           ROLLOUT_TRUNCATED_FRAC, TRAIN_LEARNER_IDLE_S, TRAIN_LEARNER_UTILIZATION,
                           TRAIN_SKIPPED_STEPS)
from echo2.seams import RolloutSource
from echo2.records import RolloutGroup

log = logging.getLogger(__name__)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, batch_std: torch.Tensor | None = None):
    """GRPO advantages, as TRL computes them: reward minus its group's mean, divided by a std.

    ``scale``: ``group`` (the group's std), ``batch`` (``batch_std``, the std over the global batch) or ``none``.
    NaN rewards (unscorable) are left out of the mean and std and get advantage 0, so they teach nothing.
    """
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    adv = grouped - mean
    if scale == "group":
        adv = adv / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards='batch' needs the batch std")
        adv = adv / (batch_std + 1e-4)
    elif scale != "none":
        raise ValueError(f"scale_rewards={scale!r}: expected one of {', '.join(SCALE_REWARDS)}")
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trained, total) parameters of the whole model. Under ZeRO-3 each process holds a shard and a parameter's own
    ``numel`` is its placeholder's (0); DeepSpeed keeps the full count in ``ds_numel``."""
    trained = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trained += n if p.requires_grad else 0
    return trained, total


class Echo2GRPOTrainer(GRPOTrainer):
    def __init__(self, *args, rollout_source: RolloutSource, staleness: int = 0, correction: str = "none",
                 is_bounds: tuple[float, float] = (0.5, 2.0), icepop_bounds: tuple[float, float] = (0.5, 5.0),
                 m2_threshold: float = 0.04, seq_bounds: tuple[float, float] = (0.5, 2.0),
                 max_log_ratio: float = 5.0, **kwargs):
        score_completions_only_on_cpu()
        super().__init__(*args, **kwargs)
        adapter_inputs_uncast_under_autocast(self.model)
        self.max_log_ratio = max_log_ratio  # nats: rollout.max_log_ratio (corrections.bound_log_ratio)
        self.bounded_tokens = self.skipped_steps = 0  # cumulative, every process's
        self._step_bounded = 0  # this process's bounded tokens in the step in progress
        self._step_loss_finite = True  # whether every micro-batch of the step in progress gave a finite loss here
        self._bound_in: dict | None = None  # the micro-batch whose old logprobs the next forward pass bounds
        self.correction, self.is_bounds = correction, is_bounds
        # rollout.correction with its thresholds (echo2/learner/corrections.py); self.correction stays its name.
        self.correction_spec = Correction(correction, is_bounds=tuple(is_bounds), icepop_bounds=tuple(icepop_bounds),
                                          m2_threshold=m2_threshold, seq_bounds=tuple(seq_bounds))
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            raise ValueError("echo2's learner takes one optimizer step per pass over a batch: steps_per_generation = "
                             "gradient_accumulation_steps (the micro-batches of one slice)")
        if (self.loss_type == "bnpo" and self.args.gradient_accumulation_steps > 1
                and (self._entropy_bonus_enabled or self.aux_loss_enabled)):
            raise ValueError("loss_type=bnpo with learner.micro_batch_size and an entropy bonus or router aux loss: "
                             "not supported (bnpo's per-slice normalisation is applied to the whole loss); use one "
                             "micro-batch or another loss_type")
        self.rollout_source = rollout_source
        # the rollout checks score a worker's tokens under the version it claims (S past versions kept when checked)
        self.past_policies = PastPolicies(staleness, rollout_source.check_every_steps)
        self._t_start = 0.0  # set at the first batch
        self._idle_s = self._idle_total_s = 0.0  # time spent obtaining rollouts, not training
        # echo2 writes its own per-step records and progress bar; drop HF's printer of raw log dicts.
        self.remove_callback(PrinterCallback)
        self.rollouts_consumed = 0
        self.last_groups: list[RolloutGroup] = []  # the batch of the step in progress (for the consumed log)
        self.batch_version = -1  # the version the newest batch was taken at (its μ passes train from there)
        self.batch_lag_mean = 0.0  # that batch's mean policy lag when taken, versions

    def backend(self) -> str:
        """What runs the optimizer: ``deepspeed-zero<N>``, ``ddp`` or ``single``."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None:
            return f"deepspeed-zero{plugin.zero_stage}"
        return "ddp" if self.accelerator.num_processes > 1 else "single"

    def weights(self) -> PolicyWeights:
        """The live weights as a snapshot, in the dtype the workers serve: bf16 when training in bf16 (fp32 master
        weights stay here), else the weights' own. A LoRA policy's snapshot is its adapter alone."""
        dtype = torch.bfloat16 if self.args.bf16 else next(self.model.parameters()).dtype
        return PolicyWeights(self.model, dtype, rank=self.accelerator.process_index, unsharded=self.live_policy,
                             adapter=self.adapter())

    def adapter(self) -> AdapterSpec | None:
        """The LoRA adapter being trained (``learner.lora``), or None for full fine-tuning."""
        peft_config = getattr(self.accelerator.unwrap_model(self.model), "peft_config", None)
        return AdapterSpec.of_peft(peft_config["default"]) if peft_config else None

    def describe_adapter(self) -> str:
        """For the learner's start-up line: the adapter's shape and size, or nothing."""
        spec = self.adapter()
        if spec is None:
            return ""
        trained, total = parameter_counts(self.model)
        return (f", LoRA rank {spec.rank} alpha {spec.alpha:g} on {', '.join(spec.target_modules)}: {trained:,} of "
                f"{total:,} parameters trained, only the adapter is published")

    @property
    def version(self) -> int:
        """Policy version: optimizer steps applied so far (docs/design.md §1)."""
        return self.state.global_step

    @contextmanager
    def live_policy(self):
        """The live model, unwrapped and (under ZeRO-3 / FSDP) with full parameters, for generation.
        Every rank must enter it together."""
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as policy,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            yield policy

    def _collect(self, rows: list[dict[str, Any]]) -> list[RolloutGroup]:
        if not self.rollout_source.needs_policy:
            return self.rollout_source.collect(rows, self.version)
        with self.live_policy() as policy:
            return self.rollout_source.collect(rows, self.version, policy)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:
            raise NotImplementedError("echo2 evaluates with its own evaluator (eval/accuracy), not Trainer.evaluate")
        group_size = self.num_generations
        rows = inputs[::group_size]  # TRL's RepeatSampler repeats each row G times in a row
        t0 = time.perf_counter()
        self._t_start = self._t_start or t0
        groups = self._collect(rows)
        self.last_groups, self.batch_version = groups, self.version
        self._idle_s = time.perf_counter() - t0
        self._idle_total_s += self._idle_s
        if len(groups) != len(rows) or any(len(g.rollouts) != group_size for g in groups):
            raise RuntimeError(f"rollout source returned {[len(g.rollouts) for g in groups]}, "
                               f"expected {len(rows)} groups of {group_size}")
        return self._batch(groups)

    def _batch(self, groups: list[RolloutGroup]) -> dict[str, Any]:
        """TRL's batch dict from scored groups: padded ids and masks, behaviour logprobs, advantages."""
        device = self.accelerator.device
        pad_id, multiple = self._tokenizer.pad_token_id, self.pad_to_multiple_of
        rollouts = [r for g in groups for r in g.rollouts]

        def padded(seqs, value, side, dtype=torch.long):
            return pad([torch.tensor(s, dtype=dtype) for s in seqs], padding_value=value, padding_side=side,
                       pad_to_multiple_of=multiple).to(device)

        prompt_ids = padded([r.prompt_ids for r in rollouts], pad_id, "left")
        prompt_mask = padded([[1] * len(r.prompt_ids) for r in rollouts], 0, "left")
        completion_ids = padded([r.completion.token_ids for r in rollouts], pad_id, "right")
        completion_mask = padded([[1] * len(r.completion.token_ids) for r in rollouts], 0, "right")
        behaviour_logps = padded([r.completion.logprobs for r in rollouts], 0.0, "right", torch.float32)
        # an episode's environment tokens: attended to, never trained on (TRL's tool_mask, padded with 1 as TRL pads)
        tool_mask = padded([r.completion.mask or [1] * len(r.completion.token_ids) for r in rollouts], 1, "right") \
            if any(r.completion.mask is not None for r in rollouts) else None
        if self.mask_truncated_completions:
            truncated = torch.tensor([r.completion.finish_reason == "length" for r in rollouts], device=device)
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask

        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32, device=device)
        all_rewards = self.accelerator.gather(rewards)
        advantages = group_advantages(rewards, self.num_generations, self.scale_rewards, nanstd(all_rewards))

        # per rollout (every process): lag, the model's completion tokens (not a multi-turn episode's environment
        # tokens, as TRL counts them), cut at max_completion_length?, all its tokens
        stats = self.accelerator.gather(torch.stack([
            torch.tensor([self.version - r.version for r in rollouts], dtype=torch.float32, device=device),
            torch.tensor([sum(r.completion.mask) if r.completion.mask else len(r.completion.token_ids)
                          for r in rollouts], dtype=torch.float32, device=device),
            torch.tensor([r.completion.finish_reason == "length" for r in rollouts], dtype=torch.float32,
                         device=device),
            torch.tensor([len(r.prompt_ids) + len(r.completion.token_ids) for r in rollouts], dtype=torch.float32,
                         device=device)], 1))
        all_lags, lengths, truncated = stats[:, 0], stats[:, 1], stats[:, 2]
        tokens = int(stats[:, 3].sum().item())  # every token in the batch, the environment's too
        self.state.num_input_tokens_seen += tokens  # as TRL counts it (its num_tokens): kept in checkpoints
        self.rollouts_consumed += len(all_rewards)
        self.batch_lag_mean = all_lags.mean().item()
        metrics = {
            REWARD_MEAN: torch.nanmean(all_rewards).item(),
            REWARD_STD: nanstd(all_rewards).item(),
            REWARD_FRAC_ZERO_STD_GROUPS: self._zero_std_fraction(all_rewards),
            BUFFER_STALENESS_MEAN: self.batch_lag_mean,
            BUFFER_STALENESS_MAX: all_lags.max().item(),
            ROLLOUT_COMPLETION_LEN_MEAN: lengths.mean().item(),
            ROLLOUT_COMPLETION_LEN_MIN: lengths.min().item(),
            ROLLOUT_COMPLETION_LEN_MAX: lengths.max().item(),
            ROLLOUT_TRUNCATED_FRAC: truncated.mean().item(),
            ROLLOUT_TOKENS: float(tokens),
            ROLLOUT_TOKENS_TOTAL: float(self.state.num_input_tokens_seen),
            ROLLOUT_CONSUMED: float(self.rollouts_consumed),
            # Idle = time this step spent obtaining rollouts (generating, for the sync source; waiting on the
            # buffer, for remote workers); utilization = 1 - idle / wall, cumulative since the first batch.
            TRAIN_LEARNER_IDLE_S: self._idle_s,
            TRAIN_LEARNER_UTILIZATION: 1.0 - self._idle_total_s / max(time.perf_counter() - self._t_start, 1e-9),
        }
        for name in rollouts[0].rewards:
            vals = torch.tensor([r.rewards[name] for r in rollouts], dtype=torch.float32, device=device)
            metrics[f"{REWARD_FUNCTION_PREFIX}{name}"] = torch.nanmean(self.accelerator.gather(vals)).item()
        metrics.update(self.rollout_source.metrics())
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        log_reward_logs(self, groups, advantages)  # the reward functions' log_metric, log_extra and errors
        log_episodes(self, groups)  # a multi-turn task's turns, tool calls, environment rewards and errors

        old_logps = behaviour_logps
        if self.correction != "none":
            old_logps, advantages = self._decoupled(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                    behaviour_logps, advantages, loss_mask)
        every = self.rollout_source.check_every_steps
        if every and self.version % every == 0 and any(g.worker_id for g in groups):
            learner_logps = old_logps if self.correction != "none" else None
            distrusted = self._check(groups, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     behaviour_logps, learner_logps, loss_mask)
            if distrusted:  # tokens the checks found implausible are not trained on (booked: dropped, untrusted)
                keep = torch.tensor([g.worker_id not in distrusted for g in groups for _ in g.rollouts], device=device)
                completion_mask = completion_mask * keep.unsqueeze(1).long()
                loss_mask = loss_mask * keep.unsqueeze(1).long()
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "old_per_token_logps": old_logps,
            "advantages": advantages,
            "num_items_in_batch": self.accelerator.gather(loss_mask.sum()).sum(),
            "slice_tokens": loss_mask.sum(),  # 0-dim: every micro-batch of the slice gets it whole
        }
        if tool_mask is not None:
            batch["tool_mask"] = tool_mask  # TRL's loss takes completion_mask * tool_mask
        if self.beta != 0.0:
            batch["ref_per_token_logps"] = self._reference_logps(prompt_ids, prompt_mask, completion_ids,
                                                                 completion_mask)
        return batch

    def _reference_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """Logprobs of the slice's completions under the frozen reference policy (the initial weights), in
        micro-batches. Under ZeRO-3 this forward is a collective: every rank runs it on a slice of equal size."""
        ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        with torch.no_grad():
            if self.ref_model is not None:
                ref, _, _ = self._get_per_token_logps_and_entropies(
                    self.ref_model, ids, mask, completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)
                return ref
            model = self.accelerator.unwrap_model(self.model)
            if not hasattr(model, "peft_config"):
                raise ValueError("learner.beta > 0 needs a reference model, and TRL kept none")
            # a LoRA policy: its reference is the base model, the adapter disabled (TRL's own choice: no second copy)
            with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                ref, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)
        return ref

    def _compute_loss(self, model, inputs):
        self._bound_in = inputs if self.model.training else None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._bound_in = None
        self._step_loss_finite &= bool(torch.isfinite(loss.detach()).all())
        k = self.current_gradient_accumulation_steps
        if self.loss_type == "bnpo" and k > 1 and self.model.training:
            # TRL: (sum over the micro-batch's tokens) / (its token count) / k. The whole slice at once would be
            # (sum over the slice's tokens) / (the slice's token count): rescale to that.
            tokens = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).sum().clamp(min=1.0)
            loss = loss * (tokens * k / inputs["slice_tokens"].clamp(min=1.0))
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """TRL's, and in the loss (``_compute_loss`` set ``_bound_in``), the micro-batch's old logprobs bounded
        against the logprobs just computed: TRL's _compute_loss takes its ratio exp(logp − old) right after this
        forward pass (tests/learner/test_trl_contract.py fails if that order changes)."""
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._bound_in = self._bound_in, None
        if inputs is not None and inputs.get("old_per_token_logps") is not None:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # the model's tokens
            inputs["old_per_token_logps"], n = bound_log_ratio(out[0], inputs["old_per_token_logps"],
                                                               self.max_log_ratio, mask)
            self._step_bounded += int(n)
        return out

    def _get_grad_norm(self, model, grad_norm=None):
        """HF's gradient norm of the step, called on every process before ``optimizer.step()``; here also the
        decision to skip the step (see the module doc): the same on every process, from the norm of the reduced
        gradient and every process's loss."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        flags = torch.tensor([float(self._step_bounded), 0.0 if self._step_loss_finite else 1.0],
                             device=self.accelerator.device)
        bounded, bad_losses = self.accelerator.reduce(flags, reduction="sum").tolist()
        self._step_bounded, self._step_loss_finite = 0, True
        norm = float(grad_norm) if grad_norm is not None else 0.0
        if self.is_deepspeed_enabled:  # the engine stepped inside backward, or skipped on a non-finite norm
            skipped = self.accelerator.optimizer_step_was_skipped
            if bad_losses and not skipped:
                log.error("step %d: a loss was not finite on %d process(es) but the gradient was, and DeepSpeed "
                          "applied the step", self.state.global_step + 1, int(bad_losses))
        else:
            skipped = bool(bad_losses) or not math.isfinite(norm)
            if skipped:  # torch optimizers step no parameter without a gradient: nothing moves, no moment changes
                for p in model.parameters():
                    p.grad = None
        if skipped:
            self.skipped_steps += 1
            log.warning("step %d skipped: gradient norm %s, %d process(es) with a non-finite loss; weights and "
                        "optimizer unchanged (%d skipped so far)", self.state.global_step + 1, norm,
                        int(bad_losses), self.skipped_steps)
        self.bounded_tokens += int(bounded)
        self._metrics["train"][ROLLOUT_BOUNDED_TOKENS].append(float(self.bounded_tokens))
        self._metrics["train"][TRAIN_SKIPPED_STEPS].append(float(self.skipped_steps))
        return grad_norm

    def _decoupled(self, prompt_ids, prompt_mask, completion_ids, completion_mask, behaviour_logps, advantages,
                   loss_mask=None):
        """Decoupled off-policy loss (``rollout.correction`` other than none): the clipped ratio is taken against
        the *proximal* policy (the learner's weights now, recomputed without grad), and each token's advantage is
        weighted by w = π_prox / π_behaviour, corrected (echo2/learner/corrections.py says how, per correction).
        Returns (old logprobs, per-token advantages)."""
        with torch.no_grad():
            prox_logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
                completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)
        loss_mask = completion_mask if loss_mask is None else loss_mask  # the model's tokens (not the environment's)
        mask = loss_mask.bool()
        behaviour_logps, n = bound_log_ratio(prox_logps, behaviour_logps, self.max_log_ratio, loss_mask)
        self._step_bounded += int(n)
        log_ratio = (prox_logps - behaviour_logps) * loss_mask
        keep = self._m2po_keep(log_ratio, mask) if self.correction == "m2po" else None
        weights = importance_weights(log_ratio, self.correction_spec, mask, keep)
        self._log_correction(log_ratio, weights, mask)
        return prox_logps, advantages.unsqueeze(1) * weights

    def _m2po_keep(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """M2PO's choice over the whole batch of R rollouts, of which this process holds a slice: the (log w)² of
        every process's real tokens are gathered (each slice padded to the longest with -1, which no square is),
        every process runs the same selection on the same values, and keeps its own part."""
        squared = log_ratio[mask].square()
        if self.accelerator.num_processes == 1:
            return m2po_keep(squared, self.correction_spec.m2_threshold)
        padded = self.accelerator.pad_across_processes(squared, pad_index=-1.0)
        everyone = self.accelerator.gather(padded)
        keep = torch.ones_like(everyone, dtype=torch.bool)
        real = everyone >= 0
        keep[real] = m2po_keep(everyone[real], self.correction_spec.m2_threshold)
        mine = keep.view(self.accelerator.num_processes, -1)[self.accelerator.process_index]
        return mine[:squared.numel()]

    def _log_correction(self, log_ratio: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> None:
        """Per step, over the batch's real tokens (all processes): the raw ratio w's mean and max, the second
        moment of log w (M2PO's M2), and what the correction did: tokens dropped (weight 0), truncated (a lower,
        non-zero weight), either (is_frac_corrected), the mean weight, and the second moment of the tokens kept."""
        raw, kept = torch.exp(log_ratio)[mask], weights[mask]  # exp as importance_weights took it: same bits
        dropped = (kept == 0) & (raw > 0)
        truncated = (kept != raw) & ~dropped
        sq = log_ratio[mask].double().square()
        sums = torch.stack([mask.sum().double(), raw.double().sum(), kept.double().sum(), dropped.sum().double(),
                            truncated.sum().double(), sq.sum(), sq[kept > 0].sum(), (kept > 0).sum().double()])
        n, raw_sum, kept_sum, n_dropped, n_truncated, sq_sum, sq_kept, n_kept = (
            self.accelerator.gather(sums.unsqueeze(0)).sum(0).tolist())
        raw_max = self.accelerator.gather((raw.max() if raw.numel() else raw.new_zeros(())).reshape(1)).max().item()
        n = max(n, 1.0)
        for key, value in {
            ROLLOUT_IS_RATIO_MEAN: raw_sum / n, ROLLOUT_IS_RATIO_MAX: raw_max,
            ROLLOUT_IS_LOG_RATIO_M2: sq_sum / n, ROLLOUT_IS_LOG_RATIO_M2_KEPT: sq_kept / max(n_kept, 1.0),
            ROLLOUT_IS_WEIGHT_MEAN: kept_sum / n,
            ROLLOUT_IS_FRAC_MASKED: n_dropped / n, ROLLOUT_IS_FRAC_TRUNCATED: n_truncated / n,
            ROLLOUT_IS_FRAC_CORRECTED: (n_dropped + n_truncated) / n,
        }.items():
            self._metrics["train"][key].append(value)

    def _check(self, groups, prompt_ids, prompt_mask, completion_ids, completion_mask, behaviour_logps,
               learner_logps=None, loss_mask=None) -> set[str]:
        """Rollout checks (echo2/coordinator/trust.py): the learner's logprobs of each worker's tokens, under the
        version the worker says generated them (echo2/learner/past_policies.py), against the behaviour logprobs it
        reported; per-worker sums (tokens, Σ log-ratio, Σ |log-ratio|) go to the source, which judges; returns the
        workers whose groups in this batch must not be trained on. ``learner_logps``: the current version's, if
        computed already."""
        def logps(rows=None):
            ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
            if rows is not None:
                ids, mask = ids[rows], mask[rows]
            with torch.no_grad():
                return self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)[0]

        scored = (logps() if learner_logps is None else learner_logps).clone()
        versions = [g.version for g in groups for _ in g.rollouts]
        lagged = sorted(set(versions) & set(self.past_policies.kept) - {self.version})
        if lagged:
            with self.past_policies.swapping(self.model) as load:
                for version in lagged:
                    load(version)
                    rows = torch.tensor([i for i, v in enumerate(versions) if v == version], device=scored.device)
                    scored[rows] = logps(rows)
        checked = completion_mask if loss_mask is None else loss_mask  # the model's tokens only
        diff = (scored - behaviour_logps) * checked
        ratio, absolute = diff.sum(1).tolist(), diff.abs().sum(1).tolist()
        tokens = checked.sum(1).tolist()
        stats: dict[str, list] = {}
        workers = [g.worker_id for g in groups for _ in g.rollouts]
        for worker, n, total, total_abs in zip(workers, tokens, ratio, absolute, strict=True):
            acc = stats.setdefault(worker, [0, 0.0, 0.0])
            acc[0] += int(n)
            acc[1] += float(total)
            acc[2] += float(total_abs)
        return set(self.rollout_source.on_check({w: tuple(v) for w, v in stats.items() if w}) or ())

    def _zero_std_fraction(self, all_rewards: torch.Tensor) -> float:
        """Fraction of groups whose G rewards are all equal: they carry no GRPO signal."""
        grouped = all_rewards.view(-1, self.num_generations)
        return torch.isclose(nanstd(grouped, dim=1), torch.zeros(1, device=grouped.device)).float().mean().item()
