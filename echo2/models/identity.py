"""What a model is, for the learner and its workers to agree on: a name and a digest of its config and tokenizer.

The learner's coordinator sends its model's identity and the context length the run needs to every worker at
registration (echo2/coordinator/coordinator.py); a worker declares its own, and one that serves another model, or
too short a context, is refused with the reason and never given work. Weights are not part of the digest: they
are the learner's to broadcast, and a worker loads its initial weights from the same name.

The digest covers config.json (less the keys that say how or when a copy was saved, not what the model is) and
the tokenizer's vocabulary, special tokens and chat template, read through transformers, so that a hub id and a
local copy of the same model agree while two tiny models of different shape, or two tokenizers, do not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# Keys of config.json that describe a saved copy rather than the model.
_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "_commit_hash"}


def model_config(name_or_path: str) -> dict[str, Any]:
    """config.json of a local directory or a hub id (from the local cache, or downloaded as from_pretrained
    would)."""
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        from transformers.utils import cached_file

        path = Path(cached_file(name_or_path, "config.json"))
    return json.loads(path.read_text())


def model_identity(name_or_path: str, tokenizer: Any = None) -> dict[str, Any]:
    """``{"name", "digest", "max_position_embeddings"}`` of a model; ``tokenizer``: its loaded tokenizer, if at
    hand (else loaded here)."""
    if tokenizer is None:
        from echo2.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(name_or_path)
    config = model_config(name_or_path)
    what = {"config": {k: v for k, v in config.items() if k not in _VOLATILE},
            "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
            "special_tokens": sorted(map(str, tokenizer.all_special_tokens)),
            "chat_template": getattr(tokenizer, "chat_template", None)}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"name": str(name_or_path), "digest": digest,
            "max_position_embeddings": config.get("max_position_embeddings")}


def mismatch(needed: dict[str, Any], declared: Any) -> str | None:
    """Why a worker that declared ``declared`` (its /register body) cannot serve a run that needs ``needed``
    (``{"model": identity, "max_model_len": tokens}``); None if it can."""
    if not isinstance(declared, dict):
        return "it declared no model (start it with `python -m echo2.worker`, which declares one)"
    have, want = declared.get("model"), needed["model"]
    if not isinstance(have, dict) or "digest" not in have:
        return "it declared no model (start it with `python -m echo2.worker`, which declares one)"
    if have["digest"] != want["digest"]:
        return (f"it serves {have.get('name')!r} (digest {have['digest']}), the learner trains {want['name']!r} "
                f"(digest {want['digest']}): start the worker with the learner's model (--model)")
    length = declared.get("max_model_len")
    if not isinstance(length, int) or length < needed["max_model_len"]:
        return (f"its context is {length} tokens, the run needs {needed['max_model_len']} (the longest prompt plus "
                f"task.max_completion_length): start it with --max-model-len {needed['max_model_len']} or more")
    return None
