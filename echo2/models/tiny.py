"""A tiny random-init Qwen3-style causal LM and a character-level tokenizer, built locally.

Nothing here touches a model hub: the tokenizer is a `tokenizers` WordLevel model over single characters,
the model is `Qwen3ForCausalLM` from a config. Both are saved once into a cache folder keyed by a hash of
their settings, so every process (learner ranks, workers, tests) loads the same files.

``head_dim`` stays at 32: vLLM's CPU attention rejects 16. Embeddings are untied by default (``tie_word_embeddings``
builds a tied one, as Qwen3-0.6B and -4B are, for the tests of the worker's weight apply).

    python -c "from echo2.models.tiny import build_tiny; print(build_tiny())"
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("ECHO2_CACHE_DIR", Path.home() / ".cache" / "echo2"))


def build_tiny(
    chars: str = "0123456789+-*=% ",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 32,
    max_position_embeddings: int = 64,
    init_seed: int = 0,
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
    cache_dir: str | None = None,
    tool_chat: bool = False,
) -> str:
    """Build (once) and return the folder holding the tiny model and its tokenizer. ``tool_chat``: a tokenizer of
    printable ASCII with Qwen3's special tokens and chat template (TRL's copy of it, which TRL knows how to parse tool
    calls from), for tests of multi-turn tool use; ``chars`` is then ignored."""
    spec = dict(
        chars=chars,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        init_seed=init_seed,
    )
    if tie_word_embeddings:  # only when set, so that the untied models keep their cache folders
        spec["tie_word_embeddings"] = True
    if tool_chat:
        spec["tool_chat"] = True
        spec["chars"] = TOOL_CHAT_CHARS
    if vocab_size is not None:
        if vocab_size < len(SPECIAL_TOKENS) + len(dict.fromkeys(chars)):
            raise ValueError(f"vocab_size={vocab_size} is smaller than the {len(SPECIAL_TOKENS)} special tokens and "
                             f"{len(dict.fromkeys(chars))} characters")
        spec["vocab_size"] = vocab_size
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / "models" / f"tiny-{key}"
    root.mkdir(parents=True, exist_ok=True)
    # Several processes (DeepSpeed ranks, workers) may ask at once: one builds, the rest wait and reuse.
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists() and (out / "tokenizer.json").exists():
            return str(out)
        tmp = out.with_name(out.name + ".tmp")
        _write_tiny(tmp, spec)
        tmp.rename(out)
        log.info("built tiny model in %s", out)
    return str(out)


TOOL_CHAT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
TOOL_CHAT_SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]  # pad, eos, bos, unk: ids 0-3 as above
TOOL_CHAT_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Qwen3's markup tokens: text to its tokenizer (not special: decoding keeps them), so tool calls parse."""


def _write_tiny(out: Path, spec: dict) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if spec.get("tool_chat"):
        return _write_tool_chat(out, spec)
    chars = list(dict.fromkeys(spec["chars"]))
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    # Padding to a real model's vocabulary size (e.g. Qwen3's 151,936) with tokens no text encodes to: the model
    # gets the real embedding and head shapes, and what it samples there still decodes (to "<|pN|>").
    vocab.update({f"<|p{i}|>": i for i in range(len(vocab), spec.get("vocab_size", len(vocab)))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One token per character: the split regex keeps every character as its own piece.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=spec["max_position_embeddings"],
    )
    hf_tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
    )
    _save(out, spec, hf_tok, len(vocab), spec.get("tie_word_embeddings", False))


def _save(out: Path, spec: dict, hf_tok, vocab_size: int, tied: bool) -> None:
    """A Qwen3 model of ``spec``'s shape, initialised from its seed, saved with ``hf_tok`` and the spec in ``out``."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(spec["init_seed"])
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    (out / "echo2_spec.json").write_text(json.dumps(spec, indent=1))


def _write_tool_chat(out: Path, spec: dict) -> None:
    """The tiny model with a tool-calling chat template (see build_tiny)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {t: i for i, t in enumerate(TOOL_CHAT_SPECIAL + TOOL_CHAT_ADDED + list(dict.fromkeys(spec["chars"])))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines are characters too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(TOOL_CHAT_SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CHAT_ADDED])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                     unk_token="<unk>", padding_side="left",
                                     model_max_length=spec["max_position_embeddings"])
    hf_tok.chat_template = qwen3_chat_template
    _save(out, spec, hf_tok, len(vocab), tied=False)
