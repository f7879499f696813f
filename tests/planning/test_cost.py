"""The cost scenario (echo2/cost.py, ``python -m echo2.sim --scenario cost``): its inputs are complete, a pool
whose numbers give a known cost gives it, and the CLI prints every part of its table."""

from __future__ import annotations

import copy
import datetime
import json
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from echo2 import cost


def test_every_input_has_a_date_and_a_source():
    tree = yaml.safe_load(cost.DEFAULT_INPUTS.read_text())
    assert cost.check_inputs(tree) == []
    inputs = list(_inputs(tree))
    assert len(inputs) > 40
    for where, node in inputs:
        source = node["source"]
        assert len(source) > 20, where  # says where the figure comes from, or why it is ours
        assert isinstance(node["date"], datetime.date) and node["date"] <= datetime.date(2026, 12, 4), where
        if "range" in node:  # a sensitivity range brackets the value
            lo, hi = node["range"]
            assert lo <= node["value"] <= hi, where
    ours = [w for w, n in inputs if n["source"].startswith("assumption:")]
    assert ours and len(ours) < len(inputs)  # some figures are ours, and say so; most are public


def _inputs(tree, where=""):
    if isinstance(tree, dict) and "value" in tree:
        yield where, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _inputs(v, f"{where}.{k}".lstrip("."))


@pytest.mark.parametrize("bad, message", [
    ({"x": 3}, "the number 3 has no date or source"),
    ({"x": {"value": 3, "source": "a page"}}, "no date"),
    ({"x": {"value": 3, "date": "2026-01-02"}}, "no source"),
    ({"x": {"value": "4.0e9", "date": "2026-01-02", "source": "model card"}}, "is text, not a number"),
    ({"x": {"value": 3, "date": "2026-01-02", "source": "a page", "range": [1]}}, "range must be"),
    ({"x": {"value": {"a": 1, "b": "2e9"}, "date": "2026-01-02", "source": "a page"}}, "is text, not a number"),
])
def test_an_undated_or_unsourced_number_is_refused_by_name(bad, message, tmp_path):
    assert any(message in e for e in cost.check_inputs(bad))
    path = tmp_path / "inputs.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="x"):
        cost.load_inputs(path)


def hand_checkable() -> dict:
    """Round numbers: a 0.1B-parameter model, R = 8 x 4 = 32 rollouts of 100 + 900 tokens, one learner GPU of
    1 TFLOPS at MFU 0.192 and $3.60/h; an H100 generates 1,000 tokens/s, an RTX 4090 (1,008 / 3,350 of its
    bandwidth) 300.9; both at rollout efficiency 0.8; four $0.36/h 4090 workers to rent; no churn."""
    tree = copy.deepcopy(cost.load_inputs())
    tree["models"] = {"qwen3_4b": {k: {"value": v, "date": "2026-12-03", "source": "test"}
                                   for k, v in (("params", 1e8), ("layers", 0), ("hidden", 0), ("intermediate", 0),
                                                ("q_dim", 0), ("kv_dim", 0))}}
    v = lambda node, x: node.update(value=x)  # noqa: E731
    v(tree["shape"]["prompts_per_step"], 8)
    v(tree["shape"]["group_size"], 4)
    v(tree["shape"]["prompt_tokens"], 100)
    v(tree["shape"]["completion_tokens"], 900)
    v(tree["learner"]["gpus"], {"qwen3_4b": 1})
    v(tree["learner"]["mfu"], 0.192)
    v(tree["gpus"]["h100_sxm"]["bf16_tflops"], 1)
    v(tree["gpus"]["h100_sxm"]["usd_per_hour"], 3.6)
    v(tree["gpus"]["rtx4090"]["usd_per_hour"], 0.36)
    v(tree["generation"]["h100_anchor_tokens_per_s"], {"qwen3_4b": 1000})
    v(tree["generation"]["rollout_efficiency"], 0.8)
    v(tree["colocated"]["switch_s_per_gb"], 0.0)
    v(tree["workers"]["gpus_per_worker"], {"qwen3_4b": {"rtx4090": 1}})
    v(tree["workers"]["available_per_type"], 4)
    v(tree["workers"]["churn_per_worker_hour"], 0.0)
    v(tree["network"]["links_mbit"], [10000])
    v(tree["network"]["staleness"], [6])
    return tree


def test_a_pool_whose_numbers_give_a_known_cost():
    v = cost.values(hand_checkable())
    # T_train = 32 x 1,000 tokens x 6 x 1e8 FLOPs / (1e12 x 0.192) = 100 s; the log-prob pass a third of it.
    assert cost.train_step_s(v, "qwen3_4b") == pytest.approx(100.0)
    base = cost.colocated(v, "qwen3_4b")
    # generation: 32 x 900 tokens at 1,000 x 0.8 tokens/s = 36 s; 36 + 33.3 + 100 + 0 = 169.3 s at $3.60/h
    assert base["tp"] == 1 and base["gen_s"] == pytest.approx(36.0)
    assert base["step_s"] == pytest.approx(36 + 100 / 3 + 100)
    assert base["usd_per_step"] == pytest.approx(3.6 * base["step_s"] / 3600)
    assert base["usd_per_run"] == pytest.approx(base["usd_per_step"] * v["run"]["steps"])
    # echo2: a 4090 makes 1,000 x 1,008/3,350 x 0.8 = 240.7 tokens/s = 0.267 rollouts/s; the learner needs
    # 32 / 100 s = 0.32, so activation takes two ($0.72/h) and the learner never waits (S = 6, 10 Gbit/s):
    # (3.60 + 0.72) x 100 s / 3600 = $0.120 per step, 0.709 of the colocated step's cost.
    cell = cost.echo2_cell(v, "qwen3_4b", 10000, 6, delta=True)
    assert cell["workers"] == 2 and cell["usd_per_hour"] == pytest.approx(4.32)
    assert cell["utilization"] == pytest.approx(1.0, abs=0.03)  # the first step waits for the first batch
    assert cell["usd_per_step"] == pytest.approx(0.12, rel=0.03)
    assert cell["ratio"] == pytest.approx(0.12 / (3.6 * (36 + 100 / 3 + 100) / 3600), rel=0.03)
    assert cell["mean_lag"] > 0 and cell["solver"] in ("exact", "milp")


@pytest.mark.e2e
def test_the_scenario_prints_its_table_and_plot(tmp_path):
    """The CLI on a small grid (one model, one link, S = 2 and 6, two ranged inputs): every part of the table, the
    LoRA rows among them."""
    tree = hand_checkable()
    tree["network"]["staleness"]["value"] = [2, 6]
    for node in _walk(tree):
        if node is not tree["learner"]["mfu"] and node is not tree["workers"]["price_scale"]:
            node.pop("range", None)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(tree))
    out = subprocess.run([sys.executable, "-m", "echo2.sim", "--scenario", "cost", "--inputs", str(path), "--plot",
                          str(tmp_path / "cost.png")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "Colocated baseline" in text and "| qwen3_4b | $3.60/h | 1 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| qwen3_4b | 10 Gbit/s |")]
    assert [r.split("|")[3].strip() for r in rows] == ["2", "6", "2", "6"]  # full snapshots, then the LoRA rows
    assert "Sensitivity" in text and "| learner.mfu |" in text and "| workers.price_scale |" in text
    assert "| model | link | S | merge r8 | merge r32 | vllm r8 | vllm r32 |" in text
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    js = subprocess.run([sys.executable, "-m", "echo2.sim", "--scenario", "cost", "--inputs", str(path), "--json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    data = json.loads(js.stdout)
    assert {c["staleness"] for c in data["cells"]} == {2, 6} and {c["delta"] for c in data["cells"]} == {False, True}
    assert {(c["lora_rank"], c["lora_apply"]) for c in data["lora_cells"]} == {(8, "merge"), (8, "vllm"),
                                                                               (32, "merge"), (32, "vllm")}
    assert all({"ratio", "utilization", "mean_lag", "usd_per_run"} <= set(c) for c in data["cells"])


def _walk(tree):
    if isinstance(tree, dict) and "value" in tree:
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _walk(v)


def test_the_baseline_holds_against_a_published_colocated_step():
    """NeMo RL's Qwen3-32B GRPO on 32 H100s (376 s a step, 2026-01-20): the time model within 15 %."""
    check = cost.nemo_rl_check(cost.values(cost.load_inputs()))
    assert check["ratio"] == pytest.approx(1.0, abs=0.15)


def test_an_adapter_is_priced_from_its_models_shape_and_its_rows_are_printed():
    """A rank-r adapter on every linear layer: r · Σ(in + out) per layer (Qwen3-8B rank 8: 43.6 MB in bf16, against
    16.4 GB for the model); the LoRA rows cover every model, link, S, rank and way of applying it."""
    v = cost.values(yaml.safe_load(cost.DEFAULT_INPUTS.read_text()))
    assert cost.lora_params(4096, 4096, 1024, 12288, 36, 1) == 2_727_936
    assert cost.adapter_gb(v, "qwen3_8b", 8) == pytest.approx(0.0436, abs=1e-4)
    # a merging worker reloads the 36 blocks' linear layers (13.89 GB), not the embeddings and head (2.5 GB more)
    assert cost.linear_layers_gb(v, "qwen3_8b") == pytest.approx(13.89, abs=0.01)
    load = v["generation"]["load_s_per_gb"]
    assert cost.sim_config(v, "qwen3_8b", 100, 1, False, lora_rank=8).load_s == pytest.approx(13.89 * load, rel=1e-3)
    assert cost.sim_config(v, "qwen3_8b", 100, 1, False).load_s == pytest.approx(16.4 * load, rel=1e-3)
    lora = cost.colocated(v, "qwen3_8b", lora_rank=8)
    full = cost.colocated(v, "qwen3_8b")
    assert lora["train_s"] == pytest.approx(full["train_s"] * v["lora"]["train_compute_ratio"])
    assert lora["switch_s"] < full["switch_s"] / 100 and lora["gen_s"] == full["gen_s"]
    small = copy.deepcopy(v)
    small["network"].update(links_mbit=[100], staleness=[2])
    small["models"] = {"qwen3_8b": v["models"]["qwen3_8b"]}
    small["run"]["sim_steps"] = 20
    cell = cost.echo2_cell(small, "qwen3_8b", 100, 2, False, lora_rank=8, lora_apply="vllm")
    assert cell["lora_rank"] == 8 and cell["lora_apply"] == "vllm" and 0 < cell["ratio"] < 2
    assert cell["bcast_s"] < 10  # 44 MB over 100 Mbit/s: seconds, where the 16 GB model took over 20 minutes


def test_smaller_pulls_at_s1_keep_the_decode_rooflines_share_and_four_groups_are_the_scenarios_cell():
    """benchmarks/cost_pull_size.py: a pull of g groups keeps rate(16 g) / rate(64) of a worker's tokens/s, where a
    decode step reads the bf16 weights and every sequence's KV cache (Qwen3-8B: 16.4 GB, and 2 x 36 layers x 1,024
    x 2 bytes x 1,725 tokens = 254 MB a sequence: 0.399 at one group); its 4-group row is the cost scenario's cell."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cost_pull_size", ROOT / "benchmarks" / "cost_pull_size.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    v = cost.values(yaml.safe_load(cost.DEFAULT_INPUTS.read_text()))
    kept = {g: bench.rate_kept(v, "qwen3_8b", g) for g in (1, 2, 3, 4)}
    kv = 2 * 36 * 1024 * 2 * 1725
    assert kept[4] == 1.0 and kept[1] == pytest.approx((16 / (16.4e9 + 16 * kv)) / (64 / (16.4e9 + 64 * kv)), rel=1e-3)
    assert kept[1] == pytest.approx(0.399, abs=1e-3) and kept[1] < kept[2] < kept[3] < kept[4]
    four = bench.cell(v, "qwen3_8b", 100, 1, 8, 4, most_workers=36)
    scenario = cost.echo2_cell(v, "qwen3_8b", 100, 1, False, lora_rank=8)
    assert four["activation"]["ratio"] == pytest.approx(scenario["model_pick"]["ratio"])  # the model's own pick
    assert four["rate_kept"] == 1.0 and 1 <= four["best"]["workers"] <= 36
    # a pull of 4 groups on the cheapest worker per rollout (an RTX 5090, $0.69/h): 64 rollouts at its rate
    rtx5090 = next(w for w in cost.market(v, "qwen3_8b", 100) if w.id.startswith("rtx5090"))
    assert four["cheapest_pull_s"] == pytest.approx(64 / rtx5090.rollouts_per_s)
