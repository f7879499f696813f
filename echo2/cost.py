"""The cost question: a GRPO run on a colocated datacenter cluster against echo2's layout, per step and per run.

    python -m echo2.sim --scenario cost                            # the inputs in echo2/sim_inputs/cost.yaml
    python -m echo2.sim --scenario cost --inputs my.yaml --plot cost.png --json

**Colocated baseline** (synchronous, as verl runs it): the learner's n datacenter GPUs generate the step's R
rollouts (vLLM, tensor-parallel as fits best), recompute the old log-probs, train, and switch back (offload,
reload, weight refit), in turn; nothing overlaps:

    T_colo = R·L_c / (n · r_dc) + T_logprob + T_train + T_switch,      $/step = n · price_dc · T_colo / 3600

**echo2**: the same n GPUs only train (T_train; the behaviour log-probs come from the engines, docs/design.md §1).
Rollouts come from a market of rented GPUs on WAN links of one rate (the learner's uplink too); activation
picks the workers (echo2.activation.solve, solver ``exact``: the DP, or past its size the bounded MILP search
with its stated gap; at S = 1, where a step's rollouts come in whole pulls that the capacity model's rate cannot
see, the pick is checked in the simulator against the prefixes of 1 to 2x its size of one order, the pick cheapest
per rollout first and then the rest, echo2.sim.refine, and one 2 % cheaper is run instead) and the discrete-event
simulator (echo2.sim) runs the step loop with the buffer's own staleness rule, the relay's dissemination time,
T_load, churn: cost, learner utilization, mean lag. With sparse deltas every round carries ``delta_ratio`` × the
snapshot (the ratio measured in BENCHMARKS.md); a worker that joins still downloads the full one.

Time model (every input in the YAML with its date and source):
- T_train = R · S_len · (6N + 12·L·d·S_len) / (n · peak · MFU): PaLM's model-FLOPs accounting (arXiv
  2204.02311, App. B) with S_len = prompt + completion; the log-prob pass is a third of it (a forward).
- Generation: the output tokens/s of one H100 running vLLM, per model (a public benchmark), first freed of
  its own KV starvation, then carried to another GPU by its memory bandwidth (decode reads the weights and the
  KV cache once per token: bandwidth-bound), × ``tp_efficiency`` per doubling of tensor parallelism, × the
  starvation factor where the weights fill more than ``kv_starved_fraction`` of the worker's memory,
  × ``rollout_efficiency`` (a GRPO batch drains to its longest completion) in both layouts, × the
  worker-only ``worker_throughput_scale``.
- Snapshot: params × 2 bytes; T_load = load_s_per_gb × GB; T_switch = switch_s_per_gb × GB.
- LoRA rows (``lora``): both layouts train a rank-r adapter on every linear layer, at ``train_compute_ratio`` of
  the full step's FLOPs (the log-prob pass is a full forward either way). echo2 ships the adapter,
  r · Σ(in + out) × layers × 2 bytes, as its snapshot (no deltas: every adapter value moves each step). Its workers
  apply it two ways: ``merge`` into their weights (a reload of the adapted linear layers: T_load of their GB, 85 % of
  Qwen3-8B's, generation at full speed) or ``vllm`` through vLLM's LoRA layers (T_load of the adapter's GB, generation at
  ``served_throughput``). The baseline's switch refits only the adapter (switch_s_per_gb × its GB): the cheapest
  switch a colocated LoRA run can have.

How it differs from the paper: ECHO-2's body (shapes, prices, bandwidths, baseline details) could not be
read; it reports a *measured* 33–36 % saving for 4B/8B. This is a model from public figures and stated
assumptions; the sensitivity rows say which assumption moves the answer most, and ``nemo_rl_check`` holds
the baseline's time model against a published colocated GRPO step (NeMo RL, Qwen3-32B on 32 H100s).
"""

from __future__ import annotations

import copy
import datetime
import math
import re
from pathlib import Path
from typing import Any

import yaml

from echo2.activation.solve import Worker, evaluate, solve

DEFAULT_INPUTS = Path(__file__).resolve().parent / "sim_inputs" / "cost.yaml"
HEADLINE = {"model": "qwen3_8b", "link_mbit": 1000, "staleness": 4, "delta": True}
"""The cell the sensitivity rows move: the paper's 8B, a 1 Gbit/s WAN, S = 4, echo2's default sparse deltas."""
_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


# ---------------------------------------------------------------------- inputs


def load_inputs(path: str | Path | None = None) -> dict:
    """The YAML as written (inputs with their dates and sources); raises ValueError naming every number that
    has no date or no source."""
    tree = yaml.safe_load(Path(path or DEFAULT_INPUTS).read_text())
    errors = check_inputs(tree)
    if errors:
        raise ValueError(f"{path or DEFAULT_INPUTS}: " + "; ".join(errors))
    return tree


def check_inputs(tree: Any, where: str = "") -> list[str]:
    """Every number must sit in an input {value, date, source} (a value may be a list or mapping of numbers)."""
    if isinstance(tree, dict) and "value" in tree:
        errors = []
        date = tree.get("date")
        if not (isinstance(date, datetime.date) or (isinstance(date, str) and _DATE.match(date))):
            errors.append(f"{where}: no date (YYYY-MM-DD)")
        if not (isinstance(tree.get("source"), str) and tree["source"].strip()):
            errors.append(f"{where}: no source")
        if "range" in tree and not (isinstance(tree["range"], list) and len(tree["range"]) == 2
                                    and all(_is_number(x) for x in tree["range"])):
            errors.append(f"{where}: range must be [low, high]")
        return errors + [f"{where}: {x!r} is text, not a number (YAML wants 4.0e+9, not 4.0e9)"
                         for x in _leaves(tree["value"]) if isinstance(x, str) and _numeric_text(x)]
    if isinstance(tree, dict):
        return [e for k, v in tree.items() for e in check_inputs(v, f"{where}.{k}".lstrip("."))]
    if isinstance(tree, list):
        return [e for i, v in enumerate(tree) for e in check_inputs(v, f"{where}[{i}]")]
    return [f"{where}: the number {tree!r} has no date or source"] if _is_number(tree) else []


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _leaves(x: Any) -> list:
    if isinstance(x, dict):
        return [y for v in x.values() for y in _leaves(v)]
    return [y for v in x for y in _leaves(v)] if isinstance(x, list) else [x]


def _numeric_text(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


def values(tree: Any) -> Any:
    """The inputs' values, the dates and sources stripped."""
    if isinstance(tree, dict) and "value" in tree:
        return tree["value"]
    if isinstance(tree, dict):
        return {k: values(v) for k, v in tree.items()}
    return tree


def ranged(tree: Any, where: tuple = ()) -> list[tuple[tuple, float, float]]:
    """(path, low, high) of every input with a range: the sensitivity rows."""
    if isinstance(tree, dict) and "value" in tree:
        return [(where, *tree["range"])] if "range" in tree else []
    if isinstance(tree, dict):
        return [r for k, v in tree.items() for r in ranged(v, where + (k,))]
    return []


def with_value(tree: dict, path: tuple, value: float) -> dict:
    out = copy.deepcopy(tree)
    node = out
    for k in path:
        node = node[k]
    node["value"] = value
    return out


# ---------------------------------------------------------------------- the time model


def snapshot_gb(v: dict, model: str) -> float:
    return v["models"][model]["params"] * v["learner"]["bytes_per_param"] / 1e9


def lora_params(hidden: int, q_dim: int, kv_dim: int, intermediate: int, layers: int, rank: int) -> int:
    """Parameters of a rank-``rank`` LoRA adapter on every linear layer of a Llama/Qwen-shaped decoder (q, k, v, o,
    gate, up, down; the output head is not adapted): r · (in + out) per layer."""
    h, q, kv, mlp = hidden, q_dim, kv_dim, intermediate
    return rank * layers * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + mlp) + (mlp + h))


def adapter_gb(v: dict, model: str, rank: int) -> float:
    """A rank-``rank`` LoRA adapter on every linear layer of ``model``, in GB."""
    m = v["models"][model]
    params = lora_params(m["hidden"], m["q_dim"], m["kv_dim"], m["intermediate"], m["layers"], rank)
    return params * v["learner"]["bytes_per_param"] / 1e9


def linear_params(hidden: int, q_dim: int, kv_dim: int, intermediate: int, layers: int) -> int:
    """Weights of the linear layers of a Llama/Qwen-shaped decoder (q, k, v, o, gate, up, down: what ``lora_params``
    adapts), in·out per layer; embeddings, norms and the head are not counted."""
    h, q, kv, mlp = hidden, q_dim, kv_dim, intermediate
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * mlp)


def linear_layers_gb(v: dict, model: str) -> float:
    """The weights of ``model``'s linear layers, in GB: what a worker merging an adapter on all of them reloads per
    version (echo2/worker/engines/vllm_ext.py: the embeddings, norms and head are left as they are)."""
    m = v["models"][model]
    params = linear_params(m["hidden"], m["q_dim"], m["kv_dim"], m["intermediate"], m["layers"])
    return params * v["learner"]["bytes_per_param"] / 1e9


def train_flops(v: dict, model: str) -> float:
    """Model FLOPs of one learner step (forward and backward over R rollouts), PaLM's accounting."""
    m, sh = v["models"][model], v["shape"]
    seq = sh["prompt_tokens"] + sh["completion_tokens"]
    rollouts = sh["prompts_per_step"] * sh["group_size"]
    return rollouts * seq * (6 * m["params"] + 12 * m["layers"] * m["hidden"] * seq)


def train_step_s(v: dict, model: str) -> float:
    gpu = v["gpus"][v["learner"]["gpu"]]
    n = v["learner"]["gpus"][model]
    return train_flops(v, model) / (n * gpu["bf16_tflops"] * 1e12 * v["learner"]["mfu"])


def gen_tokens_per_s(v: dict, model: str, gpu_name: str, gpus: int) -> float:
    """Output tokens/s of one engine of ``gpus`` × ``gpu_name`` (see the module doc), before rollout_efficiency."""
    g, h100, gen = v["gpus"][gpu_name], v["gpus"]["h100_sxm"], v["generation"]
    weights_gb = snapshot_gb(v, model)
    starved = lambda n, vram: weights_gb / (n * vram) > gen["kv_starved_fraction"]  # noqa: E731
    anchor = gen["h100_anchor_tokens_per_s"][model]
    if starved(gen["anchor_gpus"], h100["vram_gb"]):
        anchor /= gen["kv_starved_factor"]  # the anchor's own starvation, divided out before scaling
    rate = anchor * g["mem_bw_gbs"] / h100["mem_bw_gbs"] * gpus * gen["tp_efficiency"] ** math.log2(gpus)
    return rate * (gen["kv_starved_factor"] if starved(gpus, g["vram_gb"]) else 1.0)


def colocated(v: dict, model: str, lora_rank: int | None = None) -> dict:
    """The baseline's step: its parts (s), $/step and $/run; the engines take the tensor parallelism that gives
    the learner GPUs the most tokens/s. ``lora_rank``: it trains a LoRA adapter instead (the module doc)."""
    n, sh, gen = v["learner"]["gpus"][model], v["shape"], v["generation"]
    tp = max((t for t in (1, 2, 4, 8) if t <= n), key=lambda t: gen_tokens_per_s(v, model, v["learner"]["gpu"], t) / t)
    per_gpu = gen_tokens_per_s(v, model, v["learner"]["gpu"], tp) / tp * gen["rollout_efficiency"]
    gen_tokens = sh["prompts_per_step"] * sh["group_size"] * sh["completion_tokens"]
    train = train_step_s(v, model)
    shipped = snapshot_gb(v, model) if lora_rank is None else adapter_gb(v, model, lora_rank)
    parts = {"gen_s": gen_tokens / (n * per_gpu), "logprob_s": train / 3 * v["colocated"]["logprob_pass"],
             "train_s": train * (1 if lora_rank is None else v["lora"]["train_compute_ratio"]),
             "switch_s": v["colocated"]["switch_s_per_gb"] * shipped}
    step = sum(parts.values())
    usd_h = n * v["gpus"][v["learner"]["gpu"]]["usd_per_hour"]
    return {**parts, "step_s": step, "tp": tp, "usd_per_hour": usd_h, "usd_per_step": usd_h * step / 3600,
            "usd_per_run": usd_h * step / 3600 * v["run"]["steps"], "hours_per_run": step * v["run"]["steps"] / 3600}


def market(v: dict, model: str, link_mbit: float, throughput: float = 1.0) -> list[Worker]:
    """The rented pool for ``model``: ``available_per_type`` workers of each type, every link at ``link_mbit``
    (``throughput``: the share of their rate they keep, e.g. serving through vLLM's LoRA layers)."""
    w, sh, gen = v["workers"], v["shape"], v["generation"]
    pool = []
    for gpu_name, gpus in w["gpus_per_worker"][model].items():
        tokens = (gen_tokens_per_s(v, model, gpu_name, gpus) * gen["rollout_efficiency"]
                  * gen["worker_throughput_scale"] * throughput)
        usd_h = round(gpus * v["gpus"][gpu_name]["usd_per_hour"] * w["price_scale"], 2)
        for i in range(int(w["available_per_type"])):
            pool.append(Worker(f"{gpu_name}x{gpus}-{i:03d}", usd_h, tokens / sh["completion_tokens"], link_mbit,
                               link_mbit, w["rtt_ms"]))
    return pool


# ---------------------------------------------------------------------- echo2 in the simulator


def sim_config(v: dict, model: str, link_mbit: float, staleness: int, delta: bool, seed: int = 0,
               lora_rank: int | None = None, lora_apply: str = "merge"):
    from echo2.sim import SimConfig

    n, sh, w = v["learner"]["gpus"][model], v["shape"], v["workers"]
    shipped_gb = snapshot_gb(v, model) if lora_rank is None else adapter_gb(v, model, lora_rank)
    # what a worker loads per version: the snapshot, the adapter into vLLM's LoRA layers, or its merge into the
    # adapted layers
    gb = shipped_gb if lora_rank is None or lora_apply == "vllm" else linear_layers_gb(v, model)
    train_s = train_step_s(v, model) * (1 if lora_rank is None else v["lora"]["train_compute_ratio"])
    return SimConfig(prompts_per_step=int(sh["prompts_per_step"]), group_size=int(sh["group_size"]),
                     train_step_s=train_s, staleness=staleness, interval=1, snapshot_bytes=shipped_gb * 1e9,
                     delta_ratio=v["network"]["delta_ratio"] if delta else 1.0, learner_uplink_mbit=link_mbit,
                     learner_usd_per_hour=n * v["gpus"][v["learner"]["gpu"]]["usd_per_hour"], broadcast="chain",
                     load_s=v["generation"]["load_s_per_gb"] * gb, groups_per_pull=int(w["groups_per_pull"]),
                     steps=int(v["run"]["sim_steps"]), churn_per_worker_hour=w["churn_per_worker_hour"],
                     rejoin_s=w["rejoin_s"], seed=seed)


def echo2_cell(v: dict, model: str, link_mbit: float, staleness: int, delta: bool, seed: int = 0,
               lora_rank: int | None = None, lora_apply: str = "merge") -> dict:
    """Activation's pick for this cell (at S − κ + 1 ≤ 1 checked in the simulator first: echo2.sim.refine; then
    ``model_pick`` holds the pick's own figures where the check replaced it, and ``solver`` and ``gap`` are the
    pick's), run in the simulator; its cost against the colocated baseline's (training the same LoRA adapter where
    ``lora_rank`` is set, its workers applying it by ``lora_apply``)."""
    from echo2.sim import one_step_window, refine, simulate, system_of

    cfg = sim_config(v, model, link_mbit, staleness, delta and lora_rank is None, seed, lora_rank, lora_apply)
    served = v["lora"]["served_throughput"] if lora_rank is not None and lora_apply == "vllm" else 1.0
    pool = market(v, model, link_mbit, served)
    system = system_of(cfg, pool)
    plan = solve(system, pool, "exact")
    active = [w for w in pool if w.id in set(plan.active)]
    base = colocated(v, model, lora_rank)
    model_pick = None  # activation's own pick, where the simulator's check replaced it
    if one_step_window(cfg):  # the check's order (the simulator's dispatch and churn draws follow a set's order)
        checked = refine(cfg, pool, plan.active)
        if {w.id for w in checked.active} != set(plan.active):
            ran = simulate(cfg, checked.pick).summary()
            model_pick = {"workers": len(checked.pick), "utilization": ran["utilization"],
                          "ratio": ran["usd_per_step"] / base["usd_per_step"]}
        active = checked.active
    result = simulate(cfg, active)
    s = result.summary()
    usd_step = s["usd_per_step"]
    kinds: dict[str, int] = {}
    for w in active:
        kinds[w.id.rsplit("-", 1)[0]] = kinds.get(w.id.rsplit("-", 1)[0], 0) + 1
    return {"model": model, "link_mbit": link_mbit, "staleness": staleness, "delta": delta, "lora_rank": lora_rank,
            "lora_apply": lora_apply if lora_rank is not None else None,
            "workers": len(active), "kinds": kinds,
            "usd_per_hour": cfg.learner_usd_per_hour + sum(w.usd_per_hour for w in active),
            "step_s": s["wall_s"] / max(s["steps"], 1), "utilization": s["utilization"],
            "mean_lag": s["staleness_mean"], "bcast_s": result.bcast_s, "usd_per_step": usd_step,
            "usd_per_run": usd_step * v["run"]["steps"], "colocated_usd_per_step": base["usd_per_step"],
            "ratio": usd_step / base["usd_per_step"], "solver": plan.solver, "gap": plan.gap,
            "predicted_utilization": evaluate(system, active).prediction.utilization, "model_pick": model_pick}


def against_paper(ratio: float, v: dict) -> str:
    lo, hi = v["paper"]["saving"]
    saving = 1 - ratio
    return "within 33-36 %" if lo <= saving <= hi else ("saves more" if saving > hi else "saves less")


def nemo_rl_check(v: dict) -> dict:
    """The baseline's time model on NeMo RL's published colocated Qwen3-32B GRPO step (inputs' nemo_rl_check)."""
    c = v["paper"]["nemo_rl_check"]
    check = copy.deepcopy(v)
    completion = c["seq_tokens"] - v["shape"]["prompt_tokens"]
    check["shape"].update(prompts_per_step=c["rollouts"] / v["shape"]["group_size"], completion_tokens=completion)
    check["learner"]["gpus"]["qwen3_32b"] = c["gpus"]
    base = colocated(check, "qwen3_32b")
    return {"published_step_s": c["step_s"], "model_step_s": base["step_s"], "ratio": base["step_s"] / c["step_s"],
            **{k: base[k] for k in ("gen_s", "logprob_s", "train_s", "switch_s", "tp")}}


# ---------------------------------------------------------------------- the scenario


def scenario(tree: dict, deltas=(False, True), sensitivity: bool = True, seed: int = 0) -> dict:
    """Every cell of the inputs' models × links × S × (full snapshots, sparse deltas), the baselines, the
    sensitivity rows (the headline cell with each ranged input at its low and its high) and the NeMo RL check."""
    v = values(tree)
    models, links, staleness = list(v["models"]), v["network"]["links_mbit"], v["network"]["staleness"]
    cells = [echo2_cell(v, m, link, S, d, seed) for m in models for link in links for S in staleness for d in deltas]
    ranks = (v.get("lora") or {}).get("ranks", [])
    lora_cells = [echo2_cell(v, m, link, S, False, seed, r, apply) for m in models for link in links
                  for S in staleness for r in ranks for apply in ("merge", "vllm")]
    return {"steps": v["run"]["steps"], "paper_saving": v["paper"]["saving"], "headline": headline(v),
            "baseline": {m: colocated(v, m) for m in models}, "cells": cells, "lora_cells": lora_cells,
            "adapter_gb": {m: {r: adapter_gb(v, m, r) for r in ranks} for m in models},
            "sensitivity": sensitivity_rows(tree, seed) if sensitivity else [],
            "nemo_rl_check": nemo_rl_check(v) if "qwen3_32b" in models else None}


def headline(v: dict) -> dict:
    """HEADLINE where the inputs have its model, link and S; else their first model, fastest link, largest S."""
    n = v["network"]
    if HEADLINE["model"] in v["models"] and HEADLINE["link_mbit"] in n["links_mbit"] and \
            HEADLINE["staleness"] in n["staleness"]:
        return dict(HEADLINE)
    return {"model": next(iter(v["models"])), "link_mbit": max(n["links_mbit"]), "staleness": max(n["staleness"]),
            "delta": True}


def sensitivity_rows(tree: dict, seed: int = 0) -> list[dict]:
    """The headline cell's ratio with each ranged input at its low and at its high, largest swing first."""
    h = headline(values(tree))
    def ratio(tree_: dict) -> float:
        return echo2_cell(values(tree_), h["model"], h["link_mbit"], h["staleness"], h["delta"], seed)["ratio"]

    rows = []
    for path, lo, hi in ranged(tree):
        r_lo, r_hi = ratio(with_value(tree, path, lo)), ratio(with_value(tree, path, hi))
        rows.append({"input": ".".join(path), "low": lo, "high": hi, "ratio_low": r_lo, "ratio_high": r_hi,
                     "swing": abs(r_hi - r_lo)})
    return sorted(rows, key=lambda r: -r["swing"])


def tables(out: dict) -> str:
    """The scenario as markdown: baselines, echo2 per model × link × S, the sensitivity rows, the NeMo RL check."""
    n = out["steps"]
    lines = [f"Colocated baseline (per step; a run = {n} steps):", "",
             "| model | learner | TP | generate s | log-probs s | train s | switch s | step s | $/step | $/run "
             "| h/run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, b in out["baseline"].items():
        lines.append(f"| {m} | ${b['usd_per_hour']:.2f}/h | {b['tp']} | {b['gen_s']:.0f} | {b['logprob_s']:.0f} | "
                     f"{b['train_s']:.0f} | {b['switch_s']:.0f} | {b['step_s']:.0f} | {b['usd_per_step']:.3f} | "
                     f"{b['usd_per_run']:.0f} | {b['hours_per_run']:.1f} |")
    lines += ["", "echo2 against it (ratio = echo2 $/step / colocated $/step; saving = 1 - ratio; the paper: 33-36 %):",
              "", "| model | link | S | full: ratio (util) | delta: workers | $/h | util | mean lag | $/step | $/run | "
              "ratio | vs paper |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(c["model"], c["link_mbit"], c["staleness"], c["delta"]): c for c in out["cells"]}
    lo, hi = out["paper_saving"]
    for (m, link, S, delta), c in by_key.items():
        if delta:
            continue
        d = by_key.get((m, link, S, True), c)
        saving = 1 - d["ratio"]
        where = "within" if lo <= saving <= hi else ("more" if saving > hi else "less")
        lines.append(f"| {m} | {_mbit(link)} | {S} | {c['ratio']:.2f} ({c['utilization']:.2f}{_pick(c)}) | "
                     f"{d['workers']} | {d['usd_per_hour']:.1f} | {d['utilization']:.2f} | {d['mean_lag']:.2f} | "
                     f"{d['usd_per_step']:.3f} | {d['usd_per_run']:.0f} | {d['ratio']:.2f}{_pick(d, ' (', ')')} | "
                     f"{where} |")
    if any(c["model_pick"] for c in out["cells"]):
        lines += ["", REFINED_NOTE]
    lines += _lora_table(out)
    h = out["headline"]
    lines += ["", f"Sensitivity: {h['model']}, {_mbit(h['link_mbit'])}, S = {h['staleness']}, sparse deltas; each "
              "ranged input at its low and high:", "", "| input | low | ratio | high | ratio | swing |",
              "|---|---|---|---|---|---|"]
    for r in out["sensitivity"]:
        lines.append(f"| {r['input']} | {r['low']:g} | {r['ratio_low']:.2f} | {r['high']:g} | {r['ratio_high']:.2f} | "
                     f"{r['swing']:.2f} |")
    c = out["nemo_rl_check"]
    if c is None:
        return "\n".join(lines)
    lines += ["", f"Baseline check: NeMo RL's published colocated Qwen3-32B GRPO step (32 H100, 2,048 rollouts) "
              f"{c['published_step_s']:.0f} s; this model {c['model_step_s']:.0f} s (generate {c['gen_s']:.0f}, "
              f"log-probs {c['logprob_s']:.0f}, train {c['train_s']:.0f}, switch {c['switch_s']:.0f}; "
              f"x{c['ratio']:.2f})."]
    return "\n".join(lines)


def _lora_table(out: dict) -> list[str]:
    """The LoRA rows: each model, link and S with a rank-r adapter trained and shipped in both layouts."""
    if not out.get("lora_cells"):
        return []
    lo, hi = out["paper_saving"]
    sizes = ", ".join(f"{m} r{r} {gb * 1e3:.0f} MB" for m, by in out["adapter_gb"].items() for r, gb in by.items())
    ranks = sorted({c["lora_rank"] for c in out["lora_cells"]})
    kinds = [(apply, r) for apply in ("merge", "vllm") for r in ranks]
    lines = ["", f"LoRA: a rank-r adapter on every linear layer trained in both layouts, only it shipped by echo2 "
             f"({sizes}; no deltas); workers merge it (a reload of the adapted layers per version) or serve it "
             "with vLLM's LoRA layers; ratio (learner utilization) = echo2 $/step / colocated LoRA $/step:", "",
             "| model | link | S | " + " | ".join(f"{a} r{r}" for a, r in kinds) + " | colocated $/step | best vs paper |",
             "|---|---|---|" + "---|" * len(kinds) + "---|---|"]
    cells = {(c["model"], c["link_mbit"], c["staleness"], c["lora_apply"], c["lora_rank"]): c for c in out["lora_cells"]}
    for m, link, S in dict.fromkeys((c["model"], c["link_mbit"], c["staleness"]) for c in out["lora_cells"]):
        row = [cells[(m, link, S, a, r)] for a, r in kinds]
        saving = 1 - min(c["ratio"] for c in row)
        where = "within" if lo <= saving <= hi else ("more" if saving > hi else "less")
        lines.append(f"| {m} | {_mbit(link)} | {S} | "
                     + " | ".join(f"{c['ratio']:.2f} ({c['utilization']:.2f}{_pick(c)})" for c in row)
                     + f" | {row[0]['colocated_usd_per_step']:.3f} | {saving:.0%} {where} |")
    if any(c["model_pick"] for c in out["lora_cells"]):
        lines += ["", REFINED_NOTE]
    return lines


REFINED_NOTE = ("\"pick\": at S = 1 activation's own pick (the capacity model's cheapest set) ran at that ratio; the "
                "row's figures are a set of 1 to 2x its size the simulator found 2 % cheaper (echo2.sim.refine).")


def _pick(c: dict, before: str = "; ", after: str = "") -> str:
    """Activation's own pick's ratio, where the simulator's check replaced it."""
    p = c.get("model_pick")
    return f"{before}pick {p['ratio']:.2f}{after}" if p else ""


def _mbit(link: float) -> str:
    return f"{link / 1000:g} Gbit/s" if link >= 1000 else f"{link:g} Mbit/s"


def plot(out: dict, path: str) -> None:
    """Ratio against S per model (a line per link; dashed: sparse deltas) with the paper's band, and the tornado."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(out["baseline"])
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
    lo, hi = out["paper_saving"]
    for ax, m in zip(axes, models):
        cells = [c for c in out["cells"] if c["model"] == m]
        for link in sorted({c["link_mbit"] for c in cells}):
            for delta, style in ((False, "-"), (True, "--")):
                pts = sorted((c["staleness"], c["ratio"]) for c in cells
                             if c["link_mbit"] == link and c["delta"] == delta)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{_mbit(link)}{' delta' if delta else ''}")
        ax.axhspan(1 - hi, 1 - lo, color="green", alpha=0.2, label="paper: 33-36 % saving")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="S", ylabel="echo2 $/step ÷ colocated", title=m, ylim=(0, 2))
        ax.legend(fontsize=7)
    rows = out["sensitivity"][:12][::-1]
    ax = axes[-1]
    h = out["headline"]
    base = next((c["ratio"] for c in out["cells"] if (c["model"], c["link_mbit"], c["staleness"], c["delta"]) ==
                 (h["model"], h["link_mbit"], h["staleness"], h["delta"])), None)
    for i, r in enumerate(rows):
        ax.plot([r["ratio_low"], r["ratio_high"]], [i, i], lw=6, color="tab:blue", solid_capstyle="butt")
    ax.set_yticks(range(len(rows)), [r["input"].split(".")[-1] for r in rows], fontsize=7)
    if base is not None:
        ax.axvline(base, color="k", lw=0.8)
    ax.set(xlabel="ratio (low to high input)", title="sensitivity (headline cell)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
