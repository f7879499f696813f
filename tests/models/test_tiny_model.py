"""The tiny model and tokenizer are built locally, cached, and fit vLLM-CPU's constraints."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformers import AutoConfig, AutoTokenizer

from echo2.models.tiny import build_tiny


def test_built_once_and_reused(tiny_model_dir):
    mtime = (Path(tiny_model_dir) / "config.json").stat().st_mtime
    assert build_tiny() == tiny_model_dir
    assert (Path(tiny_model_dir) / "config.json").stat().st_mtime == mtime


def test_other_settings_get_another_folder(tiny_model_dir, tmp_path):
    other = build_tiny(hidden_size=32, cache_dir=str(tmp_path))
    assert other != tiny_model_dir and Path(other).is_relative_to(tmp_path)


def test_tokenizer_round_trips_one_char_per_token(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.unk_token_id not in ids
    assert tok.decode(ids) == "12+7="
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+7="


def test_config_suits_vllm_cpu(tiny_model_dir):
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert cfg.head_dim == 32  # vLLM's CPU attention rejects 16
    assert cfg.tie_word_embeddings is False  # reload_weights would leave a tied head stale


def test_vocabulary_padded_to_a_real_models_size(tiny_model_dir, tmp_path):
    """vocab_size gives the real embedding and head shapes (Qwen3: 151,936 rows); text encodes as before, and a
    padding token the model samples decodes to its own name."""
    from transformers import AutoModelForCausalLM

    padded = build_tiny(vocab_size=300, tie_word_embeddings=True, cache_dir=str(tmp_path))
    tok, plain = AutoTokenizer.from_pretrained(padded), AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(padded)
    assert len(tok) == 300 and model.get_input_embeddings().weight.shape[0] == 300
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tok("12+7=")["input_ids"] == plain("12+7=")["input_ids"]
    assert tok.decode([299]) == "<|p299|>"
    with pytest.raises(ValueError, match="smaller than"):
        build_tiny(vocab_size=10, cache_dir=str(tmp_path))
