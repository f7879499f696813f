"""The learner's warning before an out-of-memory kill: one micro-batch's activations, counted from the model's shape,
against the memory free on its device (echo2/learner/args.py: activation_gib, micro_batch_advice)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from conftest import build_run, compose
from echo2.learner.args import activation_gib, micro_batch_advice

SMOLLM2 = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                          _attn_implementation="sdpa")
SMOLLM2_EAGER = SimpleNamespace(**{**vars(SMOLLM2), "_attn_implementation": "eager"})


@pytest.mark.parametrize("shape, sequences, length, peak_gib", [
    (SMOLLM2_EAGER, 4, 300, 3.72), (SMOLLM2_EAGER, 8, 300, 6.9), (SMOLLM2_EAGER, 8, 600, 14.73),
    (SMOLLM2, 4, 300, 2.0), (SMOLLM2, 8, 300, 5.57), (SMOLLM2, 8, 600, 10.74)])
def test_the_count_is_near_what_smollm2_measured(shape, sequences, length, peak_gib):
    """Peaks measured on SmolLM2-135M (float32, LoRA rank 8 on every linear layer, eager attention or SDPA): the
    rise of the process's peak RSS over one forward/backward of ``sequences`` x ``length`` tokens, 2026-12-05."""
    assert activation_gib(shape, sequences * length, length, 4, False) == pytest.approx(peak_gib, rel=0.25)


def test_a_shape_it_does_not_know_gives_no_count_and_no_warning():
    """A model whose config has no hidden size or layer count (a state-space model, say) is not estimated, and a
    multimodal one is counted by its text part."""
    assert activation_gib(SimpleNamespace(d_model=768), 1000, 100, 4, False) is None
    cfg = compose(["task=dataset", "task.data_files=x.jsonl"])
    assert micro_batch_advice(cfg, 1, SimpleNamespace(d_model=768), free_gib=0.001) is None
    nested = SimpleNamespace(get_text_config=lambda: SMOLLM2, _attn_implementation="sdpa")
    assert activation_gib(nested, 1000, 100, 4, False) == activation_gib(SMOLLM2, 1000, 100, 4, False)


def test_a_whole_step_at_once_on_the_real_model_is_warned_with_a_size_that_fits():
    """What a new user ran (task=dataset with its defaults, P=16 x G=8, 256 completion tokens, on SmolLM2 in float32):
    one forward/backward of all 128 sequences, which took the learner past 21 GiB and on towards an OOM kill without
    a word. Now it is warned at start, with a micro-batch size that divides the slice and fits."""
    cfg = compose(["task=dataset", "task.data_files=x.jsonl", "model=smollm2_135m", "model.dtype=float32"])
    advice = micro_batch_advice(cfg, 1, SMOLLM2, free_gib=22.0, prompt_tokens=20)
    assert advice is not None and "128 sequences of up to 276 tokens" in advice, advice
    size = int(advice.split("learner.micro_batch_size=")[2].split(" ")[0])
    assert 128 % size == 0 and activation_gib(SMOLLM2, size * 276, 276, 4, False) <= 11.0
    assert micro_batch_advice(cfg, 1, SMOLLM2, free_gib=200.0, prompt_tokens=20) is None
    # training's own state still to come (gradients and Adam's moments of the trained parameters) counts against it
    assert micro_batch_advice(cfg, 1, SMOLLM2, free_gib=200.0, prompt_tokens=20, trained_params=15 * 2**30) is not None
    fitted = compose(["task=dataset", "task.data_files=x.jsonl", "model=smollm2_135m", "model.dtype=float32",
                      f"learner.micro_batch_size={size}"])
    assert micro_batch_advice(fitted, 1, SMOLLM2, free_gib=22.0, prompt_tokens=20) is None


@pytest.mark.parametrize("experiment, prompt_tokens", [("smollm2_arith", 45), ("smollm2_arith_lora", 45),
                                                       ("smollm2_poker", 106)])
def test_the_shipped_experiments_fit_this_machine_class(experiment, prompt_tokens):
    """They ran here (24 GiB, about 20 free) without a warning to give, at their longest prompts in SmolLM2's tokens
    (measured with longest_prompt over every train row, 2026-12-05), full fine-tuning's state included."""
    cfg = compose([f"experiment={experiment}", "model.dtype=float32"])
    assert micro_batch_advice(cfg, 1, SMOLLM2_EAGER, free_gib=16.0, prompt_tokens=prompt_tokens,
                              trained_params=135_000_000) is None


def test_train_logs_it(tmp_path, caplog, monkeypatch):
    from echo2.learner import args

    monkeypatch.setattr(args, "free_memory_gib", lambda device, processes_here: 1e-6)
    with caplog.at_level(logging.WARNING):
        build_run(tmp_path, ["rollout=sync", "run.steps=1"])
    assert any("of activations by a rough count, against 0.0 GiB free on the learner's device for them. If memory "
               "runs out, set learner.gradient_checkpointing=true" in r.getMessage() for r in caplog.records)
