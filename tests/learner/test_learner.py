"""The learner: behaviour logprobs are the old policy, every parameter trains, advantages match TRL's."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import WrappedSource, build_run
from echo2.learner.trainer import group_advantages
from echo2.models.generate import HFEngine
from echo2.records import SamplingParams


def build(tmp_path, overrides):
    return build_run(tmp_path, ["rollout=sync", *overrides])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_learners(tiny_model_dir, temperature):
    """On-policy behaviour logprobs equal what the learner recomputes, so the S=0 ratio is exactly 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = HFEngine(tok.pad_token_id, [tok.eos_token_id])
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["7=", "12+3=", "4+4="]]
    groups = engine.generate(model, prompts, SamplingParams(n=4, max_tokens=6, temperature=temperature))
    checked = 0
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")
            checked += len(c.token_ids)
    assert checked > 12


def test_group_advantages_like_trl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, math.nan, 0.0])
    adv = group_advantages(rewards, 4, "none")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 1 / 3, 1 / 3, 0.0, -2 / 3]))
    scaled = group_advantages(rewards, 4, "group")
    assert scaled[0] == pytest.approx(0.75 / (0.5 + 1e-4), rel=1e-5)  # group std of [1,0,0,0] is 0.5
    assert scaled[6] == 0.0  # unscorable: no signal
    assert group_advantages(torch.ones(4), 4, "group").abs().max() == 0
    with pytest.raises(ValueError):
        group_advantages(rewards, 4, "bogus")


def test_every_parameter_changes(tmp_path):
    cfg, trainer, source, _ = build(tmp_path, ["run.steps=3"])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    assert trainer.version == 3 and trainer.rollouts_consumed == 3 * 16 * 8


class ShiftedLogprobs(WrappedSource):
    """A stub source: the sync source's rollouts with every behaviour logprob lowered by ``shift`` nats."""

    def __init__(self, inner, shift):
        super().__init__(inner)
        self.shift = shift

    def collect(self, rows, version, policy=None):
        groups = self.inner.collect(rows, version, policy)
        for g in groups:
            for r in g.rollouts:
                r.completion.logprobs = [lp - self.shift for lp in r.completion.logprobs]
        return groups


@pytest.mark.parametrize("shift, clipped", [(0.0, False), (1.0, True)])
def test_behaviour_logprobs_are_the_old_policy(tmp_path, shift, clipped):
    """Ratio = exp(logp - behaviour): on-policy it is 1, so nothing is clipped; lowering the behaviour logprobs
    by a nat makes it e > 1 + epsilon, so every token with a positive advantage is clipped (TRL counts a token
    as clipped only where the clip binds: ratio high and advantage > 0). If the learner recomputed "old"
    with its own weights, both cases would show 0."""
    cfg, trainer, source, _ = build(tmp_path, ["run.steps=2"])
    trainer.rollout_source = ShiftedLogprobs(source, shift)
    trainer.train()
    region = [h["clip_ratio/region_mean"] for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert len(region) == 2
    if clipped:
        assert min(region) > 0
    else:
        assert max(region) == 0.0


@pytest.mark.parametrize("loss_type, extra", [
    ("grpo", []), ("bnpo", []), ("dr_grpo", []), ("dapo", []), ("cispo", []), ("sapo", []),
    ("luspo", ["+learner.trl.importance_sampling_level=sequence"]),
])
def test_trl_loss_types_stay_selectable(tmp_path, loss_type, extra):
    cfg, trainer, source, _ = build(tmp_path, ["run.steps=1", f"learner.loss_type={loss_type}", *extra])
    assert trainer.loss_type == loss_type
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and math.isfinite(losses[0])


def first_step(tmp_path, correction, shift):
    """One sync learner step with ``rollout.correction=correction`` and every behaviour logprob lowered by
    ``shift`` nats. Returns (token ids of the batch, flattened gradient before the optimizer step, parameter
    change, the step's log record). Gradient clipping is off so the gradient is the loss's own."""
    from transformers import TrainerCallback

    cfg, trainer, source, _ = build(tmp_path / f"{correction}-{shift}", [
        "run.steps=1", f"rollout.correction={correction}", "learner.max_grad_norm=1e9"])
    trainer.rollout_source = ShiftedLogprobs(source, shift)
    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen["grad"] = torch.cat([p.grad.detach().flatten().clone() for p in trainer.model.parameters()])

    trainer.add_callback(Grab())
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    ids = [r.completion.token_ids for g in trainer.last_groups for r in g.rollouts]
    record = next(h for h in trainer.state.log_history if "rollout/consumed" in h)
    return ids, seen["grad"], after - before, record


def close(a, b, rtol=1e-3):
    return (a - b).norm() <= rtol * b.norm()


def test_importance_weights_change_the_update(tmp_path):
    """rollout.correction=tis / mask end to end, on the same batch (same seed) with the behaviour logprobs
    lowered by 1.5 nats, so every token's weight w = pi_learner / pi_behaviour is e^1.5 (~4.5), above
    rollout.is_max (2): tis truncates every weight to 2, which exactly doubles the gradient of the on-policy
    batch (w ~ 1); mask zeroes every token, so there is no gradient and no parameter moves. With a 0.3-nat
    shift (w = 1.35, inside the bounds) mask keeps the weight and scales the gradient by e^0.3. Without the
    correction the same shift moves the parameters differently again (the clipped ratio against behaviour)."""
    ids0, g0, d0, _ = first_step(tmp_path, "tis", 0.0)
    assert g0.norm() > 0
    ids, g_tis, d_tis, rec_tis = first_step(tmp_path, "tis", 1.5)
    assert ids == ids0, "not the same batch: the comparison below would mean nothing"
    assert rec_tis["rollout/is_frac_corrected"] == 1.0 and rec_tis["rollout/is_weight_mean"] == pytest.approx(2.0)
    assert close(g_tis, 2 * g0), ((g_tis - 2 * g0).norm(), g0.norm())
    assert not close(g_tis, g0, rtol=0.1)

    ids, g_mask, d_mask, rec_mask = first_step(tmp_path, "mask", 1.5)
    assert ids == ids0 and rec_mask["rollout/is_weight_mean"] == 0.0
    assert g_mask.abs().max() == 0 and d_mask.abs().max() == 0 and d_tis.abs().max() > 0

    ids, g_in, _, rec_in = first_step(tmp_path, "mask", 0.3)
    assert ids == ids0 and rec_in["rollout/is_frac_corrected"] == 0.0
    assert close(g_in, math.exp(0.3) * g0), ((g_in - math.exp(0.3) * g0).norm(), g0.norm())

    ids, _, d_none, _ = first_step(tmp_path, "none", 1.5)
    assert ids == ids0 and not close(d_none, d_tis, rtol=0.1)


def one_step(tmp_path, overrides):
    """One sync learner step with plain SGD (AdamW's first update is lr * g / |g|: float noise in a near-zero
    gradient would flip whole updates, so the weights would not show whether the gradients agree). Returns
    (token ids of the batch, gradient before the optimizer step, weights after, the step's logged loss)."""
    from transformers import TrainerCallback

    cfg, trainer, source, _ = build(tmp_path, ["run.steps=1", "+learner.trl.optim=sgd", *overrides])
    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen["grad"] = torch.cat([p.grad.detach().flatten().clone() for p in trainer.model.parameters()])

    trainer.add_callback(Grab())
    trainer.train()
    ids = [r.completion.token_ids for g in trainer.last_groups for r in g.rollouts]
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return ids, seen["grad"], torch.cat([p.detach().flatten() for p in trainer.model.parameters()]), loss, trainer


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_micro_batches_give_the_same_step(tmp_path, loss_type):
    """learner.micro_batch_size = R/4 (4 forward/backward passes, gradients accumulated) takes the same optimizer
    step as the whole batch at once: same batch, same loss, same gradient, same updated weights (float tolerance),
    for each loss type whose normalisation depends on the batch. The copy task's 2-token completions vary in length
    (EOS after 1 or 2 tokens), so bnpo's per-micro-batch token counts differ from R/4 of the slice's."""
    # R = 16 prompts x 8 = 128 rollouts (the default; with fewer, the untrained model's groups often all tie)
    common = [f"learner.loss_type={loss_type}", "learner.max_grad_norm=1e9"]
    ids, g, w, loss, trainer = one_step(tmp_path / "whole", common)
    ids4, g4, w4, loss4, trainer4 = one_step(tmp_path / "micro", [*common, "learner.micro_batch_size=32"])
    assert trainer.args.gradient_accumulation_steps == 1 and trainer4.args.gradient_accumulation_steps == 4
    assert ids == ids4, "not the same batch: the comparison below would mean nothing"
    assert len({len(i) for i in ids}) > 1, "all completions have one length: bnpo's normalisation is not exercised"
    assert g.norm() > 0 and trainer4.version == 1
    assert loss4 == pytest.approx(loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g4, g, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(w4, w, rtol=1e-5, atol=1e-7)


def test_launch_errors_say_what_to_run():
    """Checked before DeepSpeed starts (train.main): no launcher, N not dividing P, micro-batches, precision."""
    from conftest import compose
    from echo2.learner.args import check_launch

    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    zero2 = compose(["learner=zero2"])
    with pytest.raises(RuntimeError, match=r"launchers/learner\.sh N"):
        check_launch(zero2, 1, env={})
    check_launch(zero2, 2, env=launched)
    check_launch(compose([]), 1, env={})  # no DeepSpeed: no launcher needed
    with pytest.raises(ValueError, match=r"Processes that would: \[1, 2, 4, 8, 16\]"):
        check_launch(zero2, 3, env=launched)
    with pytest.raises(ValueError, match=r"micro_batch_size=24.*64 rollouts.*\[1, 2, 4, 8, 16, 32, 64\]"):
        check_launch(compose(["learner.micro_batch_size=24"]), 2, env=launched)
    with pytest.raises(ValueError, match=r"learner\.bf16=true"):
        check_launch(compose(["model.dtype=bfloat16"]), 1, env={})
    check_launch(compose(["model.dtype=bfloat16", "learner.bf16=true"]), 1, env={})
    check_launch(compose(["model.dtype=bfloat16", "learner.low_precision_weights=true"]), 1, env={})


def test_kl_is_zero_at_step_one_and_grows(tmp_path):
    """learner.beta > 0: TRL keeps a frozen copy of the initial weights and echo2 computes its logprobs, so the KL
    term is exactly 0 while the policy still is the initial one (step 1) and grows as the policy moves away; the
    reference weights themselves never change."""
    cfg, trainer, source, _ = build(tmp_path, ["run.steps=4", "learner.beta=0.04", "rollout.prompts_per_step=8"])
    ref_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kl) == 4 and kl[0] == 0.0, kl
    assert 0 < kl[1] < kl[2] < kl[3], kl
    assert all(torch.equal(a, b) for a, b in zip(ref_before, trainer.ref_model.parameters()))


def changed_fraction(tmp_path, overrides) -> tuple[float, object]:
    """Fraction of weight elements that one sync step at lr 1e-6 changes, and the trainer."""
    cfg, trainer, source, _ = build(tmp_path, ["run.steps=1", "model.dtype=bfloat16", "learner.learning_rate=1e-6",
                                               "rollout.prompts_per_step=8", *overrides])
    before = torch.cat([p.detach().float().flatten().clone() for p in trainer.model.parameters()])
    trainer.train()
    after = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])
    return (after != before).float().mean().item(), trainer


def test_bf16_keeps_fp32_master_weights_and_publishes_bf16(tmp_path):
    """learner.bf16=true: fp32 master weights (bf16 autocast compute), so a 1e-6 step moves (nearly) every weight;
    AdamW straight on bf16 weights (the explicit opt-in) rounds almost every such update away. The snapshot the
    workers get is bf16, the fp32 weights rounded, and says so in its manifest (probe dtype)."""
    from echo2.broadcast import snapshot

    moved, trainer = changed_fraction(tmp_path / "bf16", ["learner.bf16=true"])
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert moved > 0.9, moved
    moved_pure, pure = changed_fraction(tmp_path / "pure", ["learner.low_precision_weights=true"])
    assert {p.dtype for p in pure.model.parameters()} == {torch.bfloat16}
    assert moved_pure < 0.2, moved_pure
    print(f"changed by one 1e-6 step: fp32 masters {moved:.3f}, bf16 weights {moved_pure:.3f}")

    weights = trainer.weights()
    assert weights.dtype == "bfloat16" and weights.local and weights.compute_dtype == "float32"
    path = tmp_path / "snapshot.safetensors"
    weights.write(str(path))
    published = snapshot.decode(path.read_bytes())
    for name, p in trainer.model.named_parameters():
        assert published[name].dtype == torch.bfloat16 and torch.equal(published[name], p.detach().to(torch.bfloat16))

    # The probe is the fp32 weights' own logprobs, not bf16 autocast's (a worker serving the snapshot in float32
    # drifted past its tolerance from an autocast probe), and the training forward keeps its autocast.
    from echo2.models.probe import probe_logprobs

    ids = list(range(1, 17))
    wrapped = trainer.model.forward
    with torch.no_grad():
        autocast = torch.tensor(probe_logprobs(trainer.model, ids))
        plain = torch.tensor(probe_logprobs(_plain_copy(trainer.model), ids))
    probe = torch.tensor(weights.probe_logprobs(ids))
    assert (autocast - plain).abs().max() > 1e-4  # autocast does round: the check below can fail
    assert torch.allclose(probe, plain, atol=1e-6, rtol=0), (probe - plain).abs().max()
    assert trainer.model.forward == wrapped
    assert torch.equal(torch.tensor(probe_logprobs(trainer.model, ids)), autocast)


def _plain_copy(model):
    """The model in float32 without accelerate's autocast wrapper."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


# Hand-made log-ratios log w = log pi_learner - log pi_behaviour: 3 sequences of up to 3 tokens; the last token of
# sequence 1 is padding (its w of 1 must not count anywhere). Squared logs of the 8 real tokens: 0, 1.21, 1.92 |
# 0.16, 3.21 | 0.26, 0.01, 0.03 (mean 0.851). Geometric means: 0.909 | 3.0 | 0.865.
RATIOS = [[1.0, 3.0, 0.25], [1.5, 6.0, 1.0], [0.6, 0.9, 1.2]]
REAL = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
PAD = None  # a padded position: its weight is not looked at


@pytest.mark.parametrize("correction, expected", [
    # truncate at is_max = 2; nothing dropped
    (dict(mode="tis"), [[1.0, 2.0, 0.25], [1.5, 2.0, PAD], [0.6, 0.9, 1.2]]),
    # drop w outside [0.5, 2], both sides; keep the rest at w
    (dict(mode="mask"), [[1.0, 0.0, 0.0], [1.5, 0.0, PAD], [0.6, 0.9, 1.2]]),
    # the same rule within [0.5, 5]: 3.0 is kept at 3, 0.25 and 6.0 dropped
    (dict(mode="icepop"), [[1.0, 3.0, 0.0], [1.5, 0.0, PAD], [0.6, 0.9, 1.2]]),
    (dict(mode="icepop", icepop_bounds=(0.2, 7.0)), [[1.0, 3.0, 0.25], [1.5, 6.0, PAD], [0.6, 0.9, 1.2]]),
    # m2po, tau = 1: the batch's mean (0.851) is under tau, nothing dropped, although sequence 1's own is 1.69
    (dict(mode="m2po", m2_threshold=1.0), [[1.0, 3.0, 0.25], [1.5, 6.0, PAD], [0.6, 0.9, 1.2]]),
    # tau = 0.8: dropping 6.0 leaves 0.514 (had the padding counted, the mean 0.757 would have dropped nothing)
    (dict(mode="m2po", m2_threshold=0.8), [[1.0, 3.0, 0.25], [1.5, 0.0, PAD], [0.6, 0.9, 1.2]]),
    # tau = 0.1: 6.0, 0.25, 3.0 dropped (0.279 after two, 0.094 after three)
    (dict(mode="m2po", m2_threshold=0.1), [[1.0, 0.0, 0.0], [1.5, 0.0, PAD], [0.6, 0.9, 1.2]]),
    # tau = 0.04: then 0.6 (0.052) and 1.5 (0.015): five dropped
    (dict(mode="m2po", m2_threshold=0.04), [[1.0, 0.0, 0.0], [0.0, 0.0, PAD], [0.0, 0.9, 1.2]]),
    # seq_mask: sequence 1 (geometric mean 3) dropped whole, 1.5 with it; the others weighted as tis (0.25 kept)
    (dict(mode="seq_mask"), [[1.0, 2.0, 0.25], [0.0, 0.0, PAD], [0.6, 0.9, 1.2]]),
    (dict(mode="seq_mask", seq_bounds=(0.88, 3.0)), [[1.0, 2.0, 0.25], [1.5, 2.0, PAD], [0.0, 0.0, 0.0]]),
    (dict(mode="seq_mask", is_bounds=(0.5, 10.0), seq_bounds=(0.5, 3.5)), [[1.0, 3.0, 0.25], [1.5, 6.0, PAD],
                                                                           [0.6, 0.9, 1.2]]),
])
def test_importance_weights_keep_and_weight_exactly_these_tokens(correction, expected):
    """Each correction on hand-made log-ratios: which tokens it keeps (weight > 0) and with what weight."""
    from echo2.learner.corrections import Correction, importance_weights

    real = torch.tensor(REAL, dtype=torch.bool)
    log_ratio = torch.log(torch.tensor(RATIOS)) * real  # as the learner builds it: padding at log w = 0
    weights = importance_weights(log_ratio, Correction(**correction), real)
    got = [[None if e is PAD else round(w, 4) for w, e in zip(row, erow)] for row, erow in zip(weights.tolist(),
                                                                                              expected)]
    assert got == expected


def test_tis_and_mask_weights_are_unchanged_bit_for_bit():
    """The weights of tis and mask are exactly the formulas echo2 had before the other corrections came."""
    from echo2.learner.corrections import Correction, importance_weights

    torch.manual_seed(0)
    real = torch.rand(32, 7) > 0.2
    log_ratio = torch.randn(32, 7) * 1.5 * real
    w = torch.exp(log_ratio)
    assert torch.equal(importance_weights(log_ratio, Correction("tis", is_bounds=(0.5, 2.0)), real),
                       torch.clamp(w, max=2.0))
    assert torch.equal(importance_weights(log_ratio, Correction("mask", is_bounds=(0.5, 2.0)), real),
                       torch.where((w >= 0.5) & (w <= 2.0), w, torch.zeros_like(w)))


@pytest.mark.parametrize("squared, tau, keep", [
    ([0.01, 0.02, 0.03], 0.04, [True, True, True]),  # mean under tau: nothing to do
    ([0.01, 9.0, 0.03], 0.04, [True, False, True]),  # the one outlier
    ([1.0, 1.0, 0.0], 0.5, [False, True, True]),  # dropping one of the tied 1s is enough: the first goes
    ([4.0, 4.0], 1.0, [False, False]),  # even the smallest exceeds tau: everything is dropped
    ([], 1.0, []),
])
def test_m2po_drops_the_fewest_largest_tokens(squared, tau, keep):
    from echo2.learner.corrections import m2po_keep

    assert m2po_keep(torch.tensor(squared), tau).tolist() == keep


class TwoProcesses:
    """A stand-in for accelerate with 2 learner processes, seen from process ``rank``: ``gather`` concatenates
    both processes' tensors (``pad_across_processes`` pads each to the longer with ``pad_index``)."""

    num_processes = 2

    def __init__(self, rank, slices):
        self.process_index, self.slices = rank, slices

    def pad_across_processes(self, tensor, pad_index):
        longest = max(len(s) for s in self.slices)
        self.padded = [torch.cat([s, torch.full((longest - len(s),), pad_index)]) for s in self.slices]
        return self.padded[self.process_index]

    def gather(self, tensor):
        return torch.cat(self.padded)


def test_m2po_selects_over_the_whole_batch_when_split_across_processes():
    """With 2 learner processes, each holding half the batch, each keeps exactly its part of what M2PO keeps on
    the whole batch (the rows of process 1 are longer, so process 0's slice is padded in the gather)."""
    from types import SimpleNamespace

    from echo2.learner.corrections import Correction, m2po_keep
    from echo2.learner.trainer import Echo2GRPOTrainer

    torch.manual_seed(1)
    log_ratio = [torch.randn(3, 4) * 0.3, torch.randn(3, 6) * 0.3]
    real = [torch.rand(3, 4) > 0.3, torch.rand(3, 6) > 0.3]
    log_ratio[1][0, 1], real[1][0, 1] = 2.0, True  # an outlier on process 1 ...
    whole = m2po_keep(torch.cat([(lr[m]).square() for lr, m in zip(log_ratio, real)]), 0.04)
    assert not whole.all() and whole.any()  # ... so something is dropped, not everything
    slices = [(lr[m]).square() for lr, m in zip(log_ratio, real)]
    mine = [Echo2GRPOTrainer._m2po_keep(SimpleNamespace(accelerator=TwoProcesses(rank, slices),
                                                        correction_spec=Correction("m2po")), log_ratio[rank], real[rank])
            for rank in (0, 1)]
    assert torch.equal(torch.cat(mine), whole)


@pytest.fixture(scope="module")
def on_policy_gradient(tmp_path_factory):
    """The gradient of one sync step with the decoupled loss on on-policy data (every weight 1)."""
    ids, grad, _, _ = first_step(tmp_path_factory.mktemp("on-policy"), "tis", 0.0)
    assert grad.norm() > 0
    return ids, grad


@pytest.mark.parametrize("correction, shift, factor, masked", [
    ("icepop", 1.5, math.exp(1.5), 0.0),  # w = e^1.5 = 4.5 lies within [0.5, 5]: kept at full weight
    ("icepop", 1.7, 0.0, 1.0),  # e^1.7 = 5.5 does not
    ("m2po", 0.1, math.exp(0.1), 0.0),  # (log w)^2 = 0.01 <= 0.04 for every token: nothing to drop
    ("m2po", 1.5, 0.0, 1.0),  # 2.25 for every token: even the last exceeds 0.04, all dropped
    ("seq_mask", 0.3, math.exp(0.3), 0.0),  # every sequence's geometric mean e^0.3 is within [0.5, 2]
    ("seq_mask", 1.5, 0.0, 1.0),  # e^1.5 is not: every sequence dropped
])
def test_new_corrections_end_to_end(tmp_path, on_policy_gradient, correction, shift, factor, masked):
    """icepop, m2po and seq_mask in a real learner step, the behaviour logprobs lowered by ``shift`` nats so every
    token's w is e^shift: the gradient is e^shift times the on-policy one where the correction keeps the tokens,
    0 where it drops them; the step's record says what it did (the masked fraction, ratio, second moment)."""
    ids0, g0 = on_policy_gradient
    ids, grad, delta, rec = first_step(tmp_path, correction, shift)
    assert ids == ids0, "not the same batch: the comparison below would mean nothing"
    if factor:
        assert close(grad, factor * g0), ((grad - factor * g0).norm(), g0.norm())
    else:
        assert grad.abs().max() == 0 and delta.abs().max() == 0
    assert rec["rollout/is_frac_masked"] == masked and rec["rollout/is_frac_truncated"] == 0.0
    assert rec["rollout/is_frac_corrected"] == masked
    assert rec["rollout/is_ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert rec["rollout/is_ratio_max"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert rec["rollout/is_log_ratio_m2"] == pytest.approx(shift ** 2, rel=1e-3)
    assert rec["rollout/is_weight_mean"] == pytest.approx(factor, rel=1e-4, abs=1e-12)
