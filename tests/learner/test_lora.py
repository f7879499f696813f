"""A LoRA learner (``learner.lora``): TRL's peft_config, the adapter alone trains and is published, the KL reference
is the base with the adapter disabled, checkpoints are PEFT's, a resume restores the adapter, and the export merges
it into a model transformers loads."""

from __future__ import annotations

import pytest
import torch

from conftest import build_run, compose
from echo2.broadcast import snapshot
from echo2.broadcast.adapter import spec_of
from echo2.models.probe import probe_logprobs


def lora_run(tmp_path, *overrides):
    return build_run(tmp_path, ["rollout=sync", "learner.lora.rank=2", "learner.lora.alpha=4", *overrides])


def written(weights) -> bytes:
    return snapshot.written_bytes(weights.write)


def test_only_the_adapter_trains_and_only_the_adapter_is_published(tmp_path):
    cfg, trainer, source, _ = lora_run(tmp_path, "run.steps=2")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed), sorted(changed)[:3]
    assert any(".lora_B." in n for n in changed)  # B starts at zero: it must have moved for the policy to move
    blob = written(trainer.weights())
    tensors = snapshot.decode(blob)
    adapter = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(tensors) == len(adapter) and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in tensors)
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in tensors)  # PEFT's saved names
    spec = spec_of(snapshot.metadata(blob))
    assert (spec.rank, spec.alpha, spec.scaling) == (2, 4.0, 2.0)
    assert {"q_proj", "v_proj", "gate_proj", "down_proj"} <= set(spec.target_modules)  # all-linear
    full = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert len(blob) < full / 5


def test_under_bf16_a_lora_learner_keeps_its_frozen_base_in_the_models_dtype_and_trains_a_float32_adapter(
        tmp_path, tiny_model_dir):
    """learner.bf16 on a bf16 model: full fine-tuning loads float32 master weights; a LoRA learner needs none for its
    frozen base, so the base stays bf16 (half the memory, no cast per forward) and PEFT keeps the adapter in float32.
    The base is then the very tensors a worker loads from the same checkpoint."""
    from echo2.learner.args import master_dtype, peft_config

    cfg, trainer, source, _ = lora_run(tmp_path, "run.steps=2", "model.dtype=bfloat16", "learner.bf16=true",
                                       "learner.learning_rate=1e-3")
    assert master_dtype(cfg) == "bfloat16" and trainer.args.model_init_kwargs["dtype"] == "bfloat16"
    dtypes = {n: p.dtype for n, p in trainer.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    lora_layers = [m for m in trainer.model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert lora_layers and all(getattr(m, "_echo2_uncast", False) for m in lora_layers)  # no cast under autocast
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed), sorted(changed)[:3]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    weights = trainer.weights()
    assert weights.dtype == "bfloat16" and weights.compute_dtype == "float32"
    # the probe reads the bf16 base in float32: it is the probe of the same weights held in float32 (the checkpoint
    # rounded to bf16 as the learner loaded it, the trained adapter copied in), to float noise
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).float()
    upcast = get_peft_model(base, peft_config(cfg)).eval()
    live = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, p in upcast.named_parameters():
            p.copy_(live[name])
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
    ids = list(range(3, 20))
    expected = probe_logprobs(upcast, ids)
    torch.testing.assert_close(weights.probe_logprobs(ids), expected, atol=1e-5, rtol=0)
    assert {p.dtype for n, p in trainer.model.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
    in_bf16 = probe_logprobs(trainer.model, ids)  # the same weights' forward in bf16, for contrast
    assert max(abs(a - b) for a, b in zip(in_bf16, expected)) > 1e-4
    assert {t.dtype for t in snapshot.decode(written(weights)).values()} == {torch.bfloat16}
    full = compose(["model.dtype=bfloat16", "learner.bf16=true"])
    assert master_dtype(full) == "float32"  # full fine-tuning keeps its fp32 masters (and probes in float32)


def test_the_kl_reference_of_a_lora_policy_is_its_base_without_a_second_copy(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cfg, trainer, source, _ = lora_run(tmp_path, "run.steps=1", "learner.beta=0.04")
    assert trainer.ref_model is None  # no second copy of the model
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.5)  # the policy is now away from its base
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    ones = torch.ones_like(ids)
    ref = trainer._reference_logps(ids[:, :3], ones[:, :3], ids[:, 3:], ones[:, 3:])
    with torch.no_grad():
        logits = base(ids).logits[0, 2:-1] / trainer.temperature
    expected = logits.log_softmax(-1).gather(-1, ids[0, 3:, None]).squeeze(-1)
    torch.testing.assert_close(ref[0], expected, atol=1e-5, rtol=0)
    policy, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, ones, 3)
    assert (policy[0] - expected).abs().max() > 1e-3  # and the adapter is on again afterwards
    trainer.train()  # the KL term runs through a real step


def test_a_lora_checkpoint_is_peft_format_resumes_and_exports_a_merged_model(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import train
    from echo2.export import export

    run_dir = tmp_path / "run"
    cfg, trainer, source, _ = lora_run(run_dir, "run.steps=3", "run.save_every_steps=3")
    trainer.train()
    ckpt = run_dir / "trainer" / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        live = trainer.model(ids).logits
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(ckpt))
        torch.testing.assert_close(loaded(ids).logits, live, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(export(str(run_dir), str(tmp_path / "merged")))
        torch.testing.assert_close(merged(ids).logits, live, atol=1e-5, rtol=0)
        assert (AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits - live).abs().max() > 1e-3

    # resumed: the adapter the checkpoint holds, then training on from step 3
    cfg = compose(["rollout=sync", "learner.lora.rank=2", "learner.lora.alpha=4", "run.steps=4",
                   "run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0"])
    resumed, _, _ = train.build(cfg, str(run_dir), rank=0, world_size=1, resume=str(ckpt))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    first = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    moved = [n for n, p in resumed.model.named_parameters() if ".lora_" in n and n in first
             and not torch.equal(p.detach(), first[n].detach())]
    assert moved  # step 4 trained the restored adapter on


@pytest.mark.parametrize("overrides, needle", [
    (["learner.lora.rank=0"], "need rank >= 1"),
    (["learner.lora.rank=4", "learner.lora.dropout=1.5"], "0 <= dropout < 1"),
    (["learner.lora.rank=4", "learner.lora.alpha=0"], "alpha > 0"),
])
def test_impossible_lora_settings_are_refused_naming_the_key(overrides, needle):
    from echo2.config import validate

    with pytest.raises(ValueError, match="learner.lora") as e:
        validate(compose(overrides))
    assert needle in str(e.value)


def test_the_learning_rate_warning_knows_loras_range():
    from echo2.learner.args import learning_rate_warning

    real = ["model=smollm2_135m"]
    assert learning_rate_warning(compose([*real, "learner.learning_rate=1e-5"])) is None
    assert "1e-6..1e-5" in learning_rate_warning(compose([*real, "learner.learning_rate=3e-4"]))
    assert learning_rate_warning(compose([*real, "learner.lora.rank=8", "learner.learning_rate=1e-4"])) is None
    assert "10x" in learning_rate_warning(compose([*real, "learner.lora.rank=8", "learner.learning_rate=1e-6"]))
    assert "LoRA" in learning_rate_warning(compose([*real, "learner.lora.rank=8", "learner.learning_rate=3e-3"]))
    assert learning_rate_warning(compose(["learner.lora.rank=8"])) is None  # the tiny model: its own rates


def test_parameter_counts_read_zero3s_full_sizes_not_the_shards_placeholders():
    """Under ZeRO-3 a parameter's own numel is its placeholder's (0); the start-up line and the memory advice count
    the model's real size (``ds_numel``), as tests/scripts/zero3_snapshot.py checks on a partitioned model."""
    from echo2.learner.trainer import parameter_counts

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert parameter_counts(model) == (23, 23)
    model[0].requires_grad_(False)
    assert parameter_counts(model) == (8, 23)
    for p in model.parameters():  # what DeepSpeed leaves on a process after partitioning
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert parameter_counts(model) == (8, 23)


def test_reading_bf16_weights_in_float32_leaves_them_as_they_were_even_when_the_forward_raises():
    """echo2.models.probe.float32_compute: the forward sees float32 copies, one module at a time; afterwards every
    parameter is the very bf16 tensor it was, hooks gone, also after a forward that raised half-way."""
    from echo2.models.probe import float32_compute

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    before = [p for p in model.parameters()]
    seen = []
    model[2].register_forward_hook(lambda m, a, o: seen.append(m.weight.dtype))  # runs before float32_compute's
    x = torch.randn(3, 4)
    with float32_compute(model):
        out = model(x)
    assert out.dtype == torch.float32 and seen == [torch.float32]
    exact = x @ model[0].weight.float().T + model[0].bias.float()
    torch.testing.assert_close(out, torch.relu(exact) @ model[2].weight.float().T + model[2].bias.float())
    assert [p for p in model.parameters()] == before and all(p.dtype == torch.bfloat16 for p in before)

    boom = model[2].register_forward_hook(lambda m, a, o: 1 / 0)
    with pytest.raises(ZeroDivisionError), float32_compute(model):
        model(x)
    boom.remove()
    assert all(a is b for a, b in zip(model.parameters(), before)), "a float32 copy was left in place"
    assert not any("_echo2_half" in m.__dict__ for m in model.modules())
    assert model(x.to(torch.bfloat16)).dtype == torch.bfloat16  # the hooks are gone


def _copies(model, ids) -> tuple[int, torch.Tensor, dict]:
    """Forward and backward of ``model`` on ``ids`` under bf16 autocast: the dtype casts it ran, its loss, its grads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.casts += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    model.zero_grad()
    with Count(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
        loss.backward()
    return Count.casts, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_under_autocast_a_lora_layer_takes_its_input_uncast_with_the_same_values_and_gradients(tiny_model_dir):
    """speedups.adapter_inputs_uncast_under_autocast: a bf16 base with a float32 adapter (what learner.bf16 trains)
    skips PEFT's cast of each adapted layer's input to float32 and autocast's cast back, two copies each way per
    layer, and computes bit for bit what PEFT computes. Without autocast PEFT's cast stays (else the adapter's
    float32 matmul would get a bf16 input)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from echo2.learner.speedups import adapter_inputs_uncast_under_autocast

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    peft_model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # B starts at zero: move it, so that the adapter's path carries values and grads
    assert {p.dtype for n, p in peft_model.named_parameters() if ".lora_" in n} == {torch.float32}
    uncast = copy.deepcopy(peft_model)
    layers = adapter_inputs_uncast_under_autocast(uncast)
    assert layers == sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A")) > 0
    assert adapter_inputs_uncast_under_autocast(uncast) == 0  # idempotent
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    needs_grad = []  # the inputs of the first block's q, k, v projections need none: the base is frozen
    for module in peft_model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.register_forward_pre_hook(lambda m, a: needs_grad.append(a[0].requires_grad))
    peft_casts, peft_loss, peft_grads = _copies(peft_model, ids)
    casts, loss, grads = _copies(uncast, ids)
    assert torch.equal(loss, peft_loss)
    assert grads.keys() == peft_grads.keys() and any(".lora_A." in n for n in grads)
    for name in grads:
        assert torch.equal(grads[name], peft_grads[name]), name
    # per layer, to float32 and back in the forward, and each of those undone for the input's gradient
    assert len(needs_grad) == layers and peft_casts - casts == sum(2 + 2 * g for g in needs_grad)
    assert all(m.cast_input_dtype_enabled for m in uncast.modules() if hasattr(m, "cast_input_dtype_enabled"))
    with torch.no_grad():  # no autocast: PEFT casts the bf16 input for the float32 adapter, as before
        torch.testing.assert_close(uncast(ids).logits, peft_model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("lora, overrides", [
    (True, ["model.dtype=bfloat16", "learner.bf16=true", "learner.learning_rate=1e-3"]),
    (True, ["learner.learning_rate=1e-3"]),
    (False, ["learner.learning_rate=1e-3"]),
], ids=["lora-bf16-base", "lora-float32", "full-float32"])
def test_the_probe_computed_from_the_published_snapshot_is_the_learners_probe_of_it(tmp_path, tiny_model_dir, lora,
                                                                                      overrides):
    """What the coordinator's probe process computes (prober.SnapshotProbe: the model loaded from the files
    in the learner's base dtype, the snapshot's bytes loaded into it, a float32 forward) is what the learner's own
    probe gives for the weights the snapshot holds: the adapter as published (rounded to bf16 under learner.bf16)
    on the learner's bf16 base, or the whole model. And it describes the trained policy, not the initial one."""
    from echo2.coordinator.prober import SnapshotProbe

    run = lora_run if lora else (lambda p, *o: build_run(p, ["rollout=sync", *o]))
    cfg, trainer, source, _ = run(tmp_path, "run.steps=2", *overrides)
    trainer.train()
    weights = trainer.weights()
    assert weights.base_dtype == ("bfloat16" if "model.dtype=bfloat16" in overrides else "float32")
    blob = written(weights)
    ids = list(range(3, 20))
    beside = SnapshotProbe(tiny_model_dir, weights.base_dtype)
    got = beside(blob, ids)
    published = snapshot.decode(blob)  # the learner's live weights set to what the snapshot holds, then probed
    with torch.no_grad():
        for name, p in weights.tensors.items():
            p.copy_(published[name])
    torch.testing.assert_close(got, weights.probe_logprobs(ids), atol=2e-5, rtol=0)
    initial = SnapshotProbe(tiny_model_dir, weights.base_dtype)
    assert max(abs(a - b) for a, b in zip(got, probe_logprobs(initial.model, ids))) > 1e-3  # it moved
    assert beside(blob, ids) == got  # a second version applied to the same model: loaded again, not added


@pytest.mark.parametrize("probe_on, adapter, device, learner_probes", [
    ("auto", True, "cpu", False),  # a CPU learner's adapter: its publish would be nearly all probe
    ("auto", True, "cuda", True),  # on a GPU 33 tokens cost little; the probe process would compute on the CPU
    ("auto", False, "cpu", True),  # full weights would be copied to the probe process whole
    ("coordinator", False, "cuda", False),
    ("learner", True, "cpu", True),
])
def test_where_each_versions_probe_is_computed(probe_on, adapter, device, learner_probes):
    from types import SimpleNamespace

    from echo2.learner.sources.async_source import AsyncRolloutSource

    source = SimpleNamespace(probe_on=probe_on, probe_ids=[5, 6, 7])
    weights = SimpleNamespace(adapter=object() if adapter else None, device=device)
    got = AsyncRolloutSource.learner_probe_ids(source, weights)
    assert got == ([5, 6, 7] if learner_probes else None)
