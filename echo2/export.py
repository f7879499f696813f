"""Export a checkpoint as a model that transformers and vLLM load: a LoRA adapter merged into its base model.

    python -m echo2.export RUN_DIR/trainer/checkpoint-100 --out merged/     # or RUN_DIR: its newest checkpoint
    python -m echo2.export RUN_DIR --out merged/ --dtype bfloat16

A checkpoint of a LoRA run (``learner.lora``) holds the adapter in PEFT's format (adapter_config.json,
adapter_model.safetensors), which ``PeftModel.from_pretrained(base, CHECKPOINT)`` loads as it is; this merges it
into the base model it names (``base_model_name_or_path``, or ``--base``) with PEFT's ``merge_and_unload`` and saves
the result with the tokenizer. A checkpoint of full fine-tuning is saved again as a plain model (the trainer's
optimizer and RNG state left behind). Then ``vllm serve merged/`` or ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("echo2.export")


def checkpoint_of(path: str) -> Path:
    """``path`` itself if it is a checkpoint (it holds model or adapter weights), else the newest checkpoint of the
    run directory ``path`` (``trainer/checkpoint-<step>``)."""
    p = Path(path)
    weights = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json")
    if any((p / w).is_file() for w in weights):
        return p
    from echo2.learner.callbacks import CHECKPOINT_STATE, checkpoint_dirs, complete_checkpoints

    found = [c for _, c in sorted(checkpoint_dirs(p / "trainer").items()) if any((c / w).is_file() for w in weights)]
    if not found:
        raise FileNotFoundError(f"{path}: neither a checkpoint (no {weights[0]} or {weights[1]}) nor a run directory "
                                "with trainer/checkpoint-<step> holding weights")
    complete = [c for c in complete_checkpoints(p / "trainer") if c in found]  # a save cut short: weights maybe torn
    if not complete:
        log.warning("%s: no checkpoint was completed (%s); exporting the newest with weights, %s", path,
                    CHECKPOINT_STATE, found[-1])
    return (complete or found)[-1]


def export(checkpoint: str, out: str, base: str | None = None, dtype: str = "float32") -> Path:
    """Write ``checkpoint`` as a plain model into ``out`` (merged if it is an adapter); returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, target = checkpoint_of(checkpoint), Path(out)
    torch_dtype = getattr(torch, dtype)
    if (ckpt / "adapter_config.json").is_file():
        import json

        from peft import PeftModel

        base = base or json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
        model = PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
        log.info("merged the adapter of %s into %s", ckpt, base)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch_dtype)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(ckpt) if (ckpt / "tokenizer_config.json").is_file() else base).save_pretrained(
        target)
    log.info("saved %s", target)
    return target


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m echo2.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--out", required=True, help="where to write the model")
    p.add_argument("--base", default=None, help="the base model of an adapter (default: the one its config names)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export(args.checkpoint, args.out, args.base, args.dtype)
    except (FileNotFoundError, OSError, ValueError) as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
