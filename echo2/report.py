"""Compare runs: PNG plots and a markdown table from their run directories.

    python -m echo2.report RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth 10]
    python -m echo2.report multirun/2026-11-30/10-00-00/*     # every job of a sweep
    python -m echo2.report multirun/staleness/* --by rollout.staleness --panels rollout.correction --threshold -0.1

Reads each run's ``metrics.jsonl``, ``summary.json``, ``consumed.jsonl`` and ``.hydra/overrides.yaml`` (the
label: the overrides that differ between the runs, else the directory name) and writes to --out (default: the
current directory):

    reward.png        reward against learner step, wall-clock time and dollars (moving average of --smooth steps)
    eval.png          held-out (greedy) accuracy against learner step and wall-clock time
    staleness.png     histogram of the lag of every consumed group (step - version; from consumed.jsonl)
    utilization.png   learner utilization over time (1 - time waiting for rollouts / wall, per window)
    broadcast.png     time of each dissemination round against run time (broadcast/time_s)
    report.md         one row per run: steps, wall, reward, eval accuracy, utilization, staleness, rollouts, $

With ``--by KEY`` (a config key, read from each run's resolved config) runs are grouped by their value of KEY,
and by ``--panels KEY2`` if given; the runs within a group (a sweep's seeds) are averaged:

    reward_by_KEY.png  mean reward against step, one line per value of KEY (shaded: min to max over the group),
                       one panel per value of KEY2
    eval_by_KEY.png    mean held-out accuracy against step and wall-clock time, one line per value of KEY (shaded:
                       min to max over the group)
    report.md          also one row per group: reward and eval accuracy (mean ± sd), steps and seconds to
                       --threshold (the reward's moving average first at or above it; median over the group),
                       the lag actually consumed, and instability signs: the largest gradient norm, importance
                       ratio and reward drop (peak moving average minus the last 20 steps' mean) in the group, the
                       worst dip (the largest fall of the moving average below its best so far, recovered or not), and
                       the share of tokens the off-policy correction dropped (rollout/is_frac_masked, mean over the
                       group's steps; "-" without a correction)

The same table (for one run) ends every training run: ``summary_table``.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from echo2.metrics import (BROADCAST_TIME_S, BUFFER_STALENESS_MEAN, COST_USD, EVAL_ACCURACY, EVAL_VERSION,
                           REWARD_MEAN, ROLLOUT_IS_FRAC_MASKED, ROLLOUT_IS_RATIO_MAX, TRAIN_GRAD_NORM,
                           TRAIN_LEARNER_IDLE_S, TRAIN_LEARNER_UTILIZATION)


def load(run_dir: str | Path) -> dict[str, Any]:
    d = Path(run_dir)
    if not (d / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{d}: no metrics.jsonl (not an echo2 run directory?)")
    records = _jsonl(d / "metrics.jsonl")
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    consumed = _jsonl(d / "consumed.jsonl") if (d / "consumed.jsonl").exists() else []
    overrides = []
    if (d / ".hydra" / "overrides.yaml").exists():
        import yaml

        overrides = list(yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()) or [])
    return {"dir": d, "records": records, "summary": summary, "consumed": consumed, "overrides": overrides}


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn last line of a killed run
            pass
    return out


def labels(runs: list[dict]) -> list[str]:
    """Each run's overrides that not every run shares (a sweep's axes), else its directory name."""
    common = set.intersection(*(set(r["overrides"]) for r in runs)) if runs else set()
    out = []
    for r in runs:
        own = sorted(o for o in r["overrides"] if o not in common and not o.startswith("hydra."))
        out.append(" ".join(own) if own else r["dir"].name)
    if len(set(out)) < len(out):  # not distinguishing: fall back on the directories
        out = [r["dir"].name for r in runs]
    return out


def row(run: dict) -> dict[str, Any]:
    """The numbers of one run (from its summary, else its last records)."""
    recs, s = run["records"], run["summary"]
    last = recs[-1] if recs else {}
    rewards = [r[REWARD_MEAN] for r in recs if r.get(REWARD_MEAN) is not None]
    tail = rewards[-20:]
    lags = staleness(run)
    acc = s.get("rollout_accounting") or {}
    evals = s.get("eval_accuracy_by_step") or _record_evals(recs)
    return {
        "steps": s.get("steps", last.get("step", 0)),
        "wall_s": s.get("wall_s", last.get("time_s")),
        "reward_first": rewards[0] if rewards else None,
        "reward_last20": sum(tail) / len(tail) if tail else None,
        "eval_accuracy": evals[max(evals, key=int)] if evals else None,
        "utilization": last.get(TRAIN_LEARNER_UTILIZATION),
        "staleness_mean": sum(k * n for k, n in lags.items()) / sum(lags.values()) if lags else
        _mean([r.get(BUFFER_STALENESS_MEAN) for r in recs]),
        "consumed": acc.get("consumed"), "dropped": sum((acc.get("dropped") or {}).values()) if acc else None,
        "lost": sum((acc.get("lost") or {}).values()) if acc else None,
        "usd": last.get(COST_USD),
    }


def evaluations(run: dict) -> list[tuple[int, float, float]]:
    """(step, wall-clock s, accuracy) of each held-out evaluation; step 0 is at time 0 (before training)."""
    by_step = run["summary"].get("eval_accuracy_by_step") or _record_evals(run["records"])
    times = {r["step"]: r["time_s"] for r in run["records"]}
    return sorted((int(s), times.get(int(s), 0.0), a) for s, a in by_step.items() if int(s) == 0 or int(s) in times)


def _record_evals(records: list[dict]) -> dict[str, float]:
    """A run without its summary yet (still running): the evaluations in its records, by the version evaluated
    (``eval/version`` where a worker evaluated, a few steps before the record; else the record's step)."""
    return {str(int(r.get(EVAL_VERSION, r["step"]))): r[EVAL_ACCURACY] for r in records
            if r.get(EVAL_ACCURACY) is not None}


def staleness(run: dict) -> Counter:
    """Lag (learner step - 1 - policy version) of every consumed group: step t trains version t-1's successor."""
    return Counter(c["step"] - 1 - v for c in run["consumed"] for v in c["versions"])


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


COLUMNS = [("steps", "steps", "d"), ("wall_s", "wall s", ".1f"), ("reward_first", "reward first", ".3f"),
           ("reward_last20", "reward last 20", ".3f"), ("eval_accuracy", "eval acc", ".3f"),
           ("utilization", "learner util", ".2f"), ("staleness_mean", "mean lag", ".2f"),
           ("consumed", "consumed", "d"), ("dropped", "dropped", "d"), ("lost", "lost", "d"), ("usd", "$", ".4f")]


def markdown(runs: list[dict]) -> str:
    names = labels(runs)
    lines = ["| run | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, run in zip(names, runs, strict=True):
        r = row(run)
        lines.append(f"| {name} | " + " | ".join(_fmt(r[k], spec) for k, _, spec in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def summary_table(summary: dict[str, Any], records: list[dict]) -> str:
    """The end-of-run table (rich, for the terminal)."""
    from rich.console import Console
    from rich.table import Table

    r = row({"records": records, "summary": summary, "consumed": [], "dir": Path("."), "overrides": []})
    acc = summary.get("rollout_accounting") or {}
    t = Table(title="echo2 run summary", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for key, label, spec in COLUMNS:
        t.add_row(label, _fmt(r[key], spec))
    for what in ("dropped", "lost"):
        for reason, n in sorted((acc.get(what) or {}).items()):
            t.add_row(f"  {what}: {reason}", str(n))
    console = Console(width=100, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(t)
    return cap.get()


def plot(runs: list[dict], out: Path, smooth: int = 10) -> list[Path]:
    """The run comparison's figures in ``out``: reward (against step, time and cost), held-out accuracy, the staleness
    histogram, learner utilization and the broadcast timeline; one PNG each."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    names = [textwrap.fill(n, 40) for n in labels(runs)]  # long override lists wrap in the legends
    return [_save(figure(names, runs, smooth), out / f"{kind}.png")
            for kind, figure in (("reward", _reward_figure), ("eval", _eval_figure), ("staleness", _staleness_figure),
                                 ("utilization", _utilization_figure), ("broadcast", _broadcast_figure))]


def _moving_average(xs: list[float], window: int) -> list[float]:
    acc, q = [], []
    for x in xs:
        q = (q + [x])[-window:]
        acc.append(sum(q) / len(q))
    return acc


def _reward_figure(names: list[str], runs: list[dict], smooth: int):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, run in zip(names, runs, strict=True):
        recs = [r for r in run["records"] if r.get(REWARD_MEAN) is not None]
        y = _moving_average([r[REWARD_MEAN] for r in recs], smooth)
        axes[0].plot([r["step"] for r in recs], y, label=name)
        axes[1].plot([r["time_s"] for r in recs], y, label=name)
        cost = [(r.get(COST_USD), v) for r, v in zip(recs, y, strict=True) if r.get(COST_USD) is not None]
        if cost and max(c for c, _ in cost) > 0:
            axes[2].plot([c for c, _ in cost], [v for _, v in cost], label=name)
    for ax, xl in zip(axes, ("learner step", "wall-clock s", "cumulative $"), strict=True):
        ax.set_xlabel(xl)
        ax.set_ylabel(f"reward (moving average of {smooth})")
        ax.grid(alpha=0.3)
    if not axes[2].lines:
        axes[2].text(0.5, 0.5, "no cost recorded\n(every worker at $0/h)", ha="center", va="center",
                     transform=axes[2].transAxes)
    axes[0].legend(fontsize=8)
    return fig


def _eval_figure(names: list[str], runs: list[dict], _smooth: int):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, run in zip(names, runs, strict=True):
        points = evaluations(run)
        line, = axes[0].plot([p[0] for p in points], [p[2] for p in points], marker=".", label=name)
        axes[1].plot([p[1] for p in points], [p[2] for p in points], marker=".", color=line.get_color())
    for ax, xl in zip(axes, ("learner step", "wall-clock s"), strict=True):
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    if not axes[0].lines or not any(len(ln.get_xdata()) for ln in axes[0].lines):
        axes[0].text(0.5, 0.5, "no evaluations (run.eval_every_steps=0)", ha="center", transform=axes[0].transAxes)
    else:
        axes[0].legend(fontsize=8)
    return fig


def _staleness_figure(names: list[str], runs: list[dict], _smooth: int):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    hists = [(name, staleness(run)) for name, run in zip(names, runs, strict=True)]
    width = 0.8 / max(1, len(hists))
    for i, (name, h) in enumerate(hists):
        total = sum(h.values()) or 1
        ks = sorted(h)
        ax.bar([k + i * width for k in ks], [h[k] / total for k in ks], width=width, label=name)
    lags = sorted({k for _, h in hists for k in h})
    ax.set_xticks([k + (len(hists) - 1) * width / 2 for k in lags], [str(k) for k in lags])
    ax.set_xlabel("lag of a consumed group (versions)")
    ax.set_ylabel("fraction of groups")
    if not any(h for _, h in hists):
        ax.text(0.5, 0.5, "no consumed.jsonl (sync runs have lag 0)", ha="center", transform=ax.transAxes)
    ax.legend(fontsize=8)
    return fig


def _utilization_figure(names: list[str], runs: list[dict], smooth: int):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in zip(names, runs, strict=True):
        t, u = utilization_series(run["records"], window=smooth)
        ax.plot(t, u, label=name)
    ax.set_xlabel("wall-clock s")
    ax.set_ylabel(f"learner utilization (window of {smooth} steps)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _broadcast_figure(names: list[str], runs: list[dict], _smooth: int):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in zip(names, runs, strict=True):
        pts = [(r["time_s"], r[BROADCAST_TIME_S]) for r in run["records"] if r.get(BROADCAST_TIME_S)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", linestyle="none", label=name)
    ax.set_xlabel("wall-clock s")
    ax.set_ylabel("last dissemination round (s)")
    if not ax.lines:
        ax.text(0.5, 0.5, "no broadcasts (sync runs)", ha="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def utilization_series(records: list[dict], window: int = 10) -> tuple[list[float], list[float]]:
    """(time, 1 - idle/wall) over each window of ``window`` steps."""
    t, u = [], []
    for i in range(window, len(records), max(1, window // 2)):
        a, b = records[i - window], records[i]
        wall = b["time_s"] - a["time_s"]
        idle = sum(r.get(TRAIN_LEARNER_IDLE_S, 0.0) for r in records[i - window + 1:i + 1])
        if wall > 0:
            t.append(b["time_s"])
            u.append(max(0.0, 1 - idle / wall))
    return t, u


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------------- groups of runs (a sweep's cells)


def config_value(run: dict, key: str) -> Any:
    """``key`` (dotted) in the run's resolved config."""
    import yaml

    node: Any = yaml.safe_load((run["dir"] / "resolved_config.yaml").read_text())
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def missing_key(runs: list[dict], key: str) -> str | None:
    """Why ``key`` cannot group ``runs`` (a run whose resolved config lacks it), with the nearest key there; None
    if every run has it."""
    import difflib

    import yaml

    lacking = []
    for run in runs:
        path = run["dir"] / "resolved_config.yaml"
        node: Any = yaml.safe_load(path.read_text()) if path.exists() else None
        for part in key.split("."):
            node = node[part] if isinstance(node, dict) and part in node else KeyError
            if node is KeyError:
                lacking.append(run)
                break
    if not lacking:
        return None
    near = difflib.get_close_matches(key, sorted(config_keys(lacking[0])), n=1)
    return (f"not a key of the resolved config of {len(lacking)} of the {len(runs)} runs (e.g. "
            f"{lacking[0]['dir']}/resolved_config.yaml)" + (f"; did you mean {near[0]}?" if near else ""))


def config_keys(run: dict) -> set[str]:
    """Every dotted key of a run's resolved config."""
    import yaml

    path = run["dir"] / "resolved_config.yaml"
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        for k, v in (node or {}).items():
            out.add(prefix + str(k))
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    walk(yaml.safe_load(path.read_text()) if path.exists() else {}, "")
    return out


def moving_average(xs: list[float], window: int) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc = (acc + [x])[-window:]
        out.append(sum(acc) / len(acc))
    return out


def worst_dip(ma: list[float]) -> float | None:
    """The largest fall of a reward curve (its moving average) below its own best so far, recovered or not: the
    "reward drop" (peak against the last 20 steps) misses a dip that recovers."""
    peak, dip = -math.inf, None
    for v in ma:
        peak = max(peak, v)
        dip = max(dip or 0.0, peak - v)
    return dip


def cell_row(runs: list[dict], threshold: float | None, window: int) -> dict[str, Any]:
    """One group of runs (the seeds of a cell): means and spreads, time to threshold, lag, instability."""
    import statistics

    def spread(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None, None
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    rows = [row(r) for r in runs]
    reached_steps, reached_s, drops, dips, grad, ratio, masked = [], [], [], [], [], [], []
    for run in runs:
        recs = [r for r in run["records"] if r.get(REWARD_MEAN) is not None]
        ma = moving_average([r[REWARD_MEAN] for r in recs], window)
        hit = next((i for i, v in enumerate(ma) if threshold is not None and v >= threshold), None)
        reached_steps.append(recs[hit]["step"] if hit is not None else None)
        reached_s.append(recs[hit]["time_s"] if hit is not None else None)
        tail = [r[REWARD_MEAN] for r in recs[-20:]]
        drops.append(max(ma) - sum(tail) / len(tail) if tail else None)
        dips.append(worst_dip(ma))
        grad += [r[TRAIN_GRAD_NORM] for r in run["records"] if r.get(TRAIN_GRAD_NORM) is not None]
        ratio += [r[ROLLOUT_IS_RATIO_MAX] for r in run["records"] if r.get(ROLLOUT_IS_RATIO_MAX) is not None]
        masked += [r[ROLLOUT_IS_FRAC_MASKED] for r in run["records"] if r.get(ROLLOUT_IS_FRAC_MASKED) is not None]
    lags = sum((staleness(r) for r in runs), Counter())
    done = [s for s in reached_steps if s is not None]
    return {
        "runs": len(runs),
        "reward": spread([r["reward_last20"] for r in rows]), "eval": spread([r["eval_accuracy"] for r in rows]),
        "reached": f"{len(done)}/{len(runs)}",
        "steps_to": statistics.median(done) if done else None,
        "s_to": statistics.median([s for s in reached_s if s is not None]) if done else None,
        "lag_mean": sum(k * n for k, n in lags.items()) / sum(lags.values()) if lags else None,
        "lag_max": max(lags) if lags else None,
        "lag_at_max": lags[max(lags)] / sum(lags.values()) if lags else None,
        "grad_max": max(grad) if grad else None, "ratio_max": max(ratio) if ratio else None,
        "drop_max": max((d for d in drops if d is not None), default=None),
        "dip_max": max((d for d in dips if d is not None), default=None),
        "masked_mean": statistics.fmean(masked) if masked else None,
    }


def grouped(runs: list[dict], by: str, panels: str | None) -> dict[tuple, list[dict]]:
    """Runs by (value of ``panels``, value of ``by``), in sorted order."""
    out: dict[tuple, list[dict]] = {}
    for run in runs:
        out.setdefault((config_value(run, panels) if panels else "", config_value(run, by)), []).append(run)
    return dict(sorted(out.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])))


def grouped_markdown(groups: dict[tuple, list[dict]], by: str, panels: str | None, threshold: float | None,
                     window: int) -> str:
    def pm(pair, spec=".3f"):
        m, sd = pair
        return "-" if m is None else f"{m:{spec}} ± {sd:{spec}}"

    head = ([panels] if panels else []) + [by, "runs", "reward last 20", "eval acc",
                                           f"reached {threshold}", "steps to it", "s to it", "lag mean",
                                           "lag max (share)", "grad norm max", "IS ratio max", "reward drop max",
                                           "worst dip", "tokens masked"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (panel, value), runs in groups.items():
        c = cell_row(runs, threshold, window)
        cells = ([str(panel)] if panels else []) + [
            str(value), str(c["runs"]), pm(c["reward"]), pm(c["eval"]), c["reached"], _fmt(c["steps_to"], ".0f"),
            _fmt(c["s_to"], ".1f"), _fmt(c["lag_mean"], ".2f"),
            "-" if c["lag_max"] is None else f"{c['lag_max']} ({c['lag_at_max']:.2f})", _fmt(c["grad_max"], ".2f"),
            _fmt(c["ratio_max"], ".2f"), _fmt(c["drop_max"], ".3f"), _fmt(c["dip_max"], ".3f"),
            _fmt(c["masked_mean"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_grouped(groups: dict[tuple, list[dict]], by: str, panels: str | None, out: Path, window: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panel_values = list(dict.fromkeys(p for p, _ in groups))
    colors = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(v for _, v in groups))}  # one value, one colour
    fig, axes = plt.subplots(1, len(panel_values), figsize=(5.5 * len(panel_values), 4.5), squeeze=False,
                             sharey=True)
    for ax, panel in zip(axes[0], panel_values, strict=True):
        for (p, value), runs in groups.items():
            if p != panel:
                continue
            curves = [moving_average([r[REWARD_MEAN] for r in run["records"] if r.get(REWARD_MEAN) is not None],
                                     window) for run in runs]
            n = min(len(c) for c in curves)
            steps = list(range(1, n + 1))
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
            line, = ax.plot(steps, mean, label=f"{by.rsplit('.', 1)[-1]}={value}", color=colors[value])
            ax.fill_between(steps, [min(c[i] for c in curves) for i in range(n)],
                            [max(c[i] for c in curves) for i in range(n)], color=line.get_color(), alpha=0.15)
        ax.set_title(f"{panels}={panel}" if panels else "")
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # each panel its own: a value may be missing from some
    axes[0][0].set_ylabel(f"reward (moving average of {window}; mean over runs, min-max shaded)")
    out.mkdir(parents=True, exist_ok=True)
    return _save(fig, out / f"reward_by_{by.rsplit('.', 1)[-1]}.png")


def plot_grouped_eval(groups: dict[tuple, list[dict]], by: str, out: Path) -> Path | None:
    """Mean held-out accuracy of each group against step and wall-clock s (at the steps every run evaluated;
    shaded: min to max over the group's runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for (panel, value), runs in groups.items():
        series = [{s: (t, a) for s, t, a in evaluations(run)} for run in runs]
        steps = sorted(set.intersection(*(set(s) for s in series)))
        if not steps:
            continue
        accs = [[s[k][1] for s in series] for k in steps]
        mean = [sum(a) / len(a) for a in accs]
        label = f"{by.rsplit('.', 1)[-1]}={value}" + (f" ({panel})" if panel != "" else "")
        for ax, xs in ((axes[0], steps), (axes[1], [sum(s[k][0] for s in series) / len(series) for k in steps])):
            line, = ax.plot(xs, mean, marker=".", label=label)
            ax.fill_between(xs, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.15)
    if not axes[0].lines:
        plt.close(fig)
        return None
    for ax, xl in zip(axes, ("learner step", "wall-clock s (mean over runs)"), strict=True):
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (mean over runs, min-max shaded)")
    axes[0].legend(fontsize=8)
    return _save(fig, out / f"eval_by_{by.rsplit('.', 1)[-1]}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m echo2.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default=".", help="where the PNGs and report.md go")
    p.add_argument("--smooth", type=int, default=10, help="moving-average window, in steps")
    p.add_argument("--by", default=None, metavar="KEY", help="group runs by this config key (e.g. rollout.staleness)")
    p.add_argument("--panels", default=None, metavar="KEY", help="with --by: one panel per value of this key")
    p.add_argument("--threshold", type=float, default=None, help="with --by: the reward to time (steps, seconds)")
    args = p.parse_args(argv)
    dirs = [d for d in args.runs if (Path(d) / "metrics.jsonl").exists()]
    skipped = sorted(set(args.runs) - set(dirs))
    if not dirs:
        p.error(f"no run directory among {args.runs} (each needs a metrics.jsonl)")
    runs = [load(d) for d in dirs]
    for flag, key in (("--by", args.by), ("--panels", args.panels)):
        if key and (why := missing_key(runs, key)):
            p.error(f"{flag} {key}: {why}")
    out = Path(args.out)
    files = plot(runs, out, args.smooth)
    table = markdown(runs)
    if args.by:
        groups = grouped(runs, args.by, args.panels)
        files.append(plot_grouped(groups, args.by, args.panels, out, args.smooth))
        files += [f for f in [plot_grouped_eval(groups, args.by, out)] if f]
        table = grouped_markdown(groups, args.by, args.panels, args.threshold, args.smooth) + "\n" + table
    (out / "report.md").write_text(table)
    files.append(out / "report.md")
    print(table)
    if skipped:
        print(f"skipped (no metrics.jsonl): {' '.join(skipped)}")
    print("wrote " + " ".join(str(f) for f in files))


if __name__ == "__main__":
    main()
