"""A LoRA policy's snapshot: only the adapter travels, and every engine applies it to the base model it holds.

What the learner writes (echo2/learner/weights.py) for a PEFT model: the LoRA matrices under PEFT's own saved names
(``base_model.model.<module>.lora_A.weight`` of shape (r, in), ``...lora_B.weight`` of shape (out, r)), and in the
safetensors metadata (signed with the bytes) the adapter's configuration under ``ADAPTER_KEY``: rank, alpha, rsLoRA,
the modules it targets. A rank-8 adapter on every linear layer of SmolLM2-135M is 9.8 MB in float32 against the
model's 538 MB, so the relay, deltas and signatures carry it as they carry a full snapshot.

What an engine does with it (echo2/worker/engines/), by ``spec.merged(base, A, B)``:

    W = W_base + scaling · B A,   scaling = alpha / r   (alpha / sqrt(r) with rsLoRA; PEFT's definition)

always from the base weights the worker loaded at start (its model files, or a copy taken before the first
adapter), never from the previously merged ones, so rounding does not accumulate over versions. A vLLM worker can
instead serve the adapter through vLLM's own LoRA path (``--lora vllm``): the same bytes, written as a PEFT adapter
directory that vLLM loads under a versioned name (``peft_directory``).

A worker must hold the learner's base model: its identity is checked at registration, and after every apply the
worker's logprobs of the manifest's probe tokens must match the learner's (a different base fails there).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any

ADAPTER_KEY = "echo2_adapter"
PREFIX = "base_model.model."  # PEFT's prefix of a causal LM's module names
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter's configuration as its snapshot states it."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # module-name suffixes, as PEFT's target_modules resolved (q_proj, ...)
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def metadata(self) -> dict[str, str]:
        return {ADAPTER_KEY: json.dumps({**asdict(self), "target_modules": list(self.target_modules)})}

    def merged(self, base: Any, lora_a: Any, lora_b: Any) -> Any:
        """W_base + scaling · B A, in float32 and back to the base's dtype (the learner's PEFT forward adds the
        two products in the compute dtype; merging once in float32 is at least as exact)."""
        import torch

        f32 = torch.float32
        merged = torch.addmm(base.to(f32), lora_b.to(base.device, f32), lora_a.to(base.device, f32), alpha=self.scaling)
        return merged.to(base.dtype)  # one pass over W (the product, scaled, added as it is made)

    @classmethod
    def of_peft(cls, config: Any) -> "AdapterSpec":
        """From a peft.LoraConfig whose target_modules the PEFT model has resolved (full module paths for
        ``all-linear``): the layer names they end in (q_proj, ...), as vLLM's loader expects them."""
        targets = config.target_modules
        targets = [targets] if isinstance(targets, str) else list(targets)
        return cls(int(config.r), float(config.lora_alpha), tuple(sorted({t.rsplit(".", 1)[-1] for t in targets})),
                   bool(config.use_rslora))


def spec_of(metadata: dict[str, str]) -> AdapterSpec | None:
    """The adapter a snapshot's metadata describes, or None for a full (or delta-applied full) snapshot."""
    raw = metadata.get(ADAPTER_KEY)
    if raw is None:
        return None
    d = json.loads(raw)
    return AdapterSpec(int(d["rank"]), float(d["alpha"]), tuple(d["target_modules"]), bool(d.get("use_rslora")))


def saved_name(param_name: str) -> str | None:
    """A PEFT model's parameter name as PEFT saves it (the adapter name dropped), or None if it is not a LoRA
    matrix: ``base_model.model.x.q_proj.lora_A.default.weight`` -> ``base_model.model.x.q_proj.lora_A.weight``."""
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in param_name and param_name.endswith(".weight"):
            head, _, _ = param_name.partition(marker)
            return f"{head}.{kind}.weight"
    return None


def pairs(tensors: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{module name in the base checkpoint: (A, B)}`` from an adapter snapshot's tensors: ``model.layers.0.
    self_attn.q_proj`` for ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, t in tensors.items():
        if not name.startswith(PREFIX) or not name.endswith((_A, _B)):
            raise ValueError(f"adapter snapshot: {name!r} is not a LoRA matrix under PEFT's names")
        module = name[len(PREFIX):-len(_A)]
        a, b = out.get(module, (None, None))
        out[module] = (t, b) if name.endswith(_A) else (a, t)
    missing = [m for m, (a, b) in out.items() if a is None or b is None]
    if missing:
        raise ValueError(f"adapter snapshot: modules without both LoRA matrices: {missing[:5]}")
    return out


def base_checkpoint(model_dir: str | Path, names: set[str] | None = None,
                    modules: set[str] | None = None) -> Iterator[tuple[str, Any]]:
    """The base model's own tensors (all, those in ``names``, or those of the ``modules``: every tensor whose name
    less its last part is one of them), read from its safetensors files: the copy of the base every merge starts from
    (a worker's engine was started from this directory)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no safetensors files to merge a LoRA adapter onto")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if (names is None or name in names) and (modules is None or name.rsplit(".", 1)[0] in modules):
                    yield name, f.get_tensor(name)


def peft_directory(directory: str | Path, spec: AdapterSpec, snapshot_bytes: Any, base_model: str) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) holding the snapshot, as vLLM's
    ``/v1/load_lora_adapter`` and ``PeftModel.from_pretrained`` read one."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": list(spec.target_modules), "use_rslora": spec.use_rslora, "lora_dropout": 0.0,
              "bias": "none", "base_model_name_or_path": base_model, "modules_to_save": None, "use_dora": False,
              "fan_in_fan_out": False, "init_lora_weights": True}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    (path / "adapter_model.safetensors").write_bytes(bytes(memoryview(snapshot_bytes)))
    return path
