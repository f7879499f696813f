"""Fails when TRL changes a method echo2 overrides or calls, so an upgrade is a conscious act.

If this fails after bumping ``trl`` in requirements.txt: read the new TRL source of the method named in the
failure, adapt ``echo2/learner/trainer.py``, then update the expected signature here.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import trl
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import nanstd, pad

PINNED_TRL = "1.16.0"

EXPECTED = {
    GRPOTrainer._generate_and_score_completions: "(self, inputs: list[dict[str, torch.Tensor | typing.Any]]) "
    "-> dict[str, torch.Tensor | typing.Any]",
    GRPOTrainer._compute_loss: "(self, model, inputs)",
    GRPOTrainer._prepare_inputs: "(self, generation_batch: dict[str, torch.Tensor | typing.Any]) "
    "-> dict[str, torch.Tensor | typing.Any]",
    unwrap_model_for_generation: "(model: 'DistributedDataParallel | DeepSpeedEngine', accelerator: 'Accelerator', "
    "gather_deepspeed3_params: bool = True, generation_kwargs: dict | None = None, "
    "gradient_checkpointing_kwargs: dict | None = None)",
    pad: "(tensors: list[torch.Tensor], padding_value: int = 0, padding_side: str = 'right', "
    "pad_to_multiple_of: int | None = None) -> torch.Tensor",
    nanstd: "(tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) "
    "-> torch.Tensor",
}


def test_the_loss_takes_its_ratio_after_its_forward_pass():
    """Echo2GRPOTrainer bounds the old logprobs of a micro-batch against the logprobs TRL's _compute_loss computes
    (its override of _get_per_token_logps_and_entropies, on the loss's first call), which works only while that
    call comes before the old logprobs are read; and it decides to skip a step in HF's _get_grad_norm, which must
    still come before optimizer.step()."""
    from transformers import Trainer

    loss = inspect.getsource(GRPOTrainer._compute_loss)
    first_call = loss.index("self._get_per_token_logps_and_entropies(")
    assert first_call < loss.index('inputs.get("old_per_token_logps")') < loss.index("log_ratio = per_token_logps -")
    assert loss[:first_call].rstrip().endswith("per_token_logps, entropies, aux_loss =")
    assert str(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)).startswith(
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,")
    assert str(inspect.signature(Trainer._get_grad_norm)) == "(self, model, grad_norm=None)"
    loop = inspect.getsource(Trainer._run_epoch)
    assert loop.index("self._get_grad_norm(") < loop.index("self.optimizer.step()")


def test_trl_is_the_pinned_version():
    assert trl.__version__ == PINNED_TRL


def test_signatures_we_rely_on():
    changed = {f.__qualname__: str(inspect.signature(f)) for f, sig in EXPECTED.items()
               if str(inspect.signature(f)) != sig}
    assert not changed, f"TRL changed: {changed}"


def test_init_still_takes_our_arguments():
    params = inspect.signature(GRPOTrainer.__init__).parameters
    for name in ["model", "reward_funcs", "args", "train_dataset", "processing_class"]:
        assert name in params


def test_batch_keys_the_loss_reads():
    """_compute_loss must still read the keys echo2's batch provides, old_per_token_logps above all."""
    src = inspect.getsource(GRPOTrainer._compute_loss)
    for key in ["prompt_ids", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
                "num_items_in_batch", "ref_per_token_logps"]:
        assert f'"{key}"' in src, key


def test_bnpo_normalisation_echo2_rescales():
    """Echo2GRPOTrainer._compute_loss rescales bnpo for micro-batches assuming TRL divides by the micro-batch's token
    count and by the accumulation steps; fail if that changes."""
    src = inspect.getsource(GRPOTrainer._compute_loss)
    bnpo = src[src.index('elif self.loss_type == "bnpo":'):src.index('elif self.loss_type == "dr_grpo":')]
    assert "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)" in bnpo
    assert "self.current_gradient_accumulation_steps" in bnpo and "loss = loss / normalizer" in bnpo


def _fused_head_outputs(compact: bool, monkeypatch) -> tuple[list[int], torch.Tensor, torch.Tensor, list]:
    """A tiny Llama with TRL's fused LM head, a padded batch of two prompts and completions: how many positions the
    chunked kernel scored, the completion tokens' logprobs and entropies, and every parameter's gradient."""
    import trl.trainer.utils as trl_utils
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from echo2.learner.speedups import score_completions_only_on_cpu

    # TRL's own decision, even where this process has built a learner already; restored below
    monkeypatch.setattr(trl_utils, "_use_triton", getattr(trl_utils._use_triton, "trl_decides", trl_utils._use_triton))
    if compact:
        score_completions_only_on_cpu()
        score_completions_only_on_cpu()  # idempotent: one wrapper, not two
    scored = []
    apply = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *a: scored.append(hidden.shape[0]) or apply(hidden, *a))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, 300, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the shorter prompt
    mask[1, -2:] = 0  # right padding of the shorter completion
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-5] = -100  # the last 5 positions are the completion, as GRPOTrainer builds its labels
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    keep = labels[:, 1:] != -100
    (out.log_probs[keep].sum() + out.entropy[keep].sum()).backward()
    monkeypatch.undo()  # TRL's own _use_triton and apply again
    return scored, out.log_probs[keep].detach(), out.entropy[keep].detach(), [p.grad for p in model.parameters()]


def test_on_the_cpu_the_fused_head_scores_only_the_completion_tokens_with_the_same_values(monkeypatch):
    """TRL scores every position of the padded batch where Triton does not run (2 x 11 here); echo2 has it score only
    the completion tokens on the CPU (8), as TRL does on CUDA, and the logprobs, entropies and gradients are the
    same. Fails if TRL stops deciding this through ``trl.trainer.utils._use_triton``."""
    every_scored, logps, entropy, grads = _fused_head_outputs(False, monkeypatch)
    compact_scored, logps_c, entropy_c, grads_c = _fused_head_outputs(True, monkeypatch)
    assert every_scored == [22] and compact_scored == [8]
    torch.testing.assert_close(logps_c, logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy_c, entropy, rtol=0, atol=1e-6)
    for g_c, g in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(g_c, g, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def test_the_learner_imports_trl_without_vllm():
    """echo2/learner tells TRL that vLLM is absent (TRL imports it for its own generation, which echo2 replaces: 3-4 s
    of every learner start). In a fresh interpreter (this one may have imported vLLM already): the trainer module
    imports TRL's trainer and its vLLM generation module, and vLLM stays unimported. Fails if TRL stops reading
    ``trl.import_utils.is_vllm_available`` there, or reads it before echo2 can answer."""
    import subprocess
    import sys

    code = ("import sys, echo2.learner.trainer, trl.generation.vllm_generation as g; "
            "print('vllm', 'vllm' in sys.modules, g.is_vllm_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["vllm", "False", "False"], out.stdout  # (a library may print before)
