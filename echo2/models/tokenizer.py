"""The run's tokenizer and its stop tokens, loaded the same way by the learner, its engines and every worker.

* A pad token. Many chat models ship none (the learner pads batches, the engines pad prompts); where it is
  missing, the EOS token pads. That is safe here: completion masks are built from each completion's length, never
  by searching for the pad id. Every process loads the tokenizer through ``load_tokenizer``, so the model identity
  that workers declare (identity.py) is computed from the same special tokens as the learner's.
* Stop tokens. A chat model ends its turn with a token its chat template writes (``<|im_end|>``), which is not
  always the tokenizer's EOS: Qwen3's generation config stops on both ``<|im_end|>`` and ``<|endoftext|>``. An
  engine that stopped on fewer would let answers run on into new text. ``stop_token_ids`` is the union of the
  tokenizer's EOS and the model's generation-config EOS ids; the learner hands it to every engine in the sampling
  parameters, so vLLM and transformers stop on the same tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def load_tokenizer(name_or_path: str) -> Any:
    """The model's tokenizer, with a pad token (EOS where the model declares none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"{name_or_path}: the tokenizer has neither a pad nor an EOS token; echo2 needs an EOS "
                             "token to end completions")
        tok.pad_token = tok.eos_token
        log.info("%s declares no pad token: padding with EOS %r", name_or_path, tok.eos_token)
    return tok


def stop_token_ids(tokenizer: Any, name_or_path: str) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS and the EOS ids of the model's generation config."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = Path(name_or_path) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    if not ids:
        raise ValueError(f"{name_or_path}: no EOS token in the tokenizer or the generation config")
    return sorted(set(ids))
