"""``python -m echo2.report`` on a sweep: it groups the cells, times the threshold and shows what a correction
masked."""

from __future__ import annotations

import json

import pytest
import yaml


def fake_run(root, name, staleness, seed, rewards, lag):
    """A run directory as train.py writes one, with just what the report reads."""
    d = root / name
    d.mkdir()
    (d / "resolved_config.yaml").write_text(yaml.safe_dump({"rollout": {"staleness": staleness, "correction": "none"},
                                                            "seed": seed}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "time_s": 0.5 * (i + 1), "reward/mean": r,
                                                         "train/grad_norm": 1.0 + i}) + "\n"
                                             for i, r in enumerate(rewards)))
    (d / "consumed.jsonl").write_text("".join(json.dumps({"step": i + 1, "versions": [max(0, i - lag)] * 2}) + "\n"
                                              for i in range(len(rewards))))
    return d


def test_the_report_groups_a_sweeps_cells_and_times_the_threshold(tmp_path):
    from echo2 import report

    dirs = [fake_run(tmp_path, "a", 0, 0, [0.0] * 5 + [1.0] * 25, 0),
            fake_run(tmp_path, "b", 0, 1, [0.0] * 10 + [1.0] * 20, 0),
            fake_run(tmp_path, "c", 4, 0, [0.0] * 30, 4)]
    runs = [report.load(d) for d in dirs]
    groups = report.grouped(runs, "rollout.staleness", "rollout.correction")
    assert list(groups) == [("none", 0), ("none", 4)] and len(groups[("none", 0)]) == 2
    fresh = report.cell_row(groups[("none", 0)], threshold=0.5, window=10)
    assert fresh["reward"] == (1.0, 0.0) and fresh["reached"] == "2/2"
    assert fresh["steps_to"] == pytest.approx((10 + 15) / 2)  # the 10-step average first reaches 0.5 at 10 / 15
    assert fresh["lag_mean"] == 0 and fresh["grad_max"] == 30.0
    stale = report.cell_row(groups[("none", 4)], threshold=0.5, window=10)
    assert stale["reached"] == "0/1" and stale["steps_to"] is None and stale["lag_max"] == 4
    report.main([str(d) for d in dirs] + ["--out", str(tmp_path / "out"), "--by", "rollout.staleness", "--panels",
                                           "rollout.correction", "--threshold", "0.5"])
    assert (tmp_path / "out" / "reward_by_staleness.png").stat().st_size > 0
    assert "| none | 4 | 1 |" in (tmp_path / "out" / "report.md").read_text()


def test_the_report_shows_the_share_of_tokens_a_correction_masked(tmp_path):
    """The grouped table's "tokens masked": rollout/is_frac_masked averaged over the cell's steps; "-" for runs
    without a correction (no such metric)."""
    from echo2 import report

    masked = fake_run(tmp_path, "masked", 8, 0, [0.0] * 30, 8)
    records = [json.loads(line) for line in (masked / "metrics.jsonl").read_text().splitlines()]
    (masked / "metrics.jsonl").write_text("".join(json.dumps({**r, "rollout/is_frac_masked": 0.1 * (i % 2)}) + "\n"
                                                  for i, r in enumerate(records)))
    plain = fake_run(tmp_path, "plain", 8, 1, [0.0] * 30, 8)
    runs = [report.load(masked), report.load(plain)]
    assert report.cell_row(runs[:1], None, 10)["masked_mean"] == pytest.approx(0.05)
    assert report.cell_row(runs[1:], None, 10)["masked_mean"] is None
    table = report.grouped_markdown(report.grouped(runs, "seed", None), "seed", None, None, 10).splitlines()
    assert table[0].endswith("| tokens masked |")
    assert table[2].endswith("| 0.050 |") and table[3].endswith("| - |")


def test_a_mistyped_grouping_key_is_refused_with_the_nearest(tmp_path, capsys):
    """--by rollout.stalenes used to group every run under None; it is refused, naming the key it is near."""
    from echo2 import report

    dirs = [fake_run(tmp_path, "a", 0, 0, [0.0] * 5, 0), fake_run(tmp_path, "b", 2, 0, [0.0] * 5, 2)]
    for flag in ("--by", "--panels"):
        with pytest.raises(SystemExit):
            report.main([str(d) for d in dirs] + ["--out", str(tmp_path / "out"), "--by", "seed", flag,
                                                   "rollout.stalenes"])
        err = capsys.readouterr().err
        assert f"{flag} rollout.stalenes: not a key of the resolved config of 2 of the 2 runs" in err
        assert "did you mean rollout.staleness?" in err
    assert not (tmp_path / "out" / "reward_by_stalenes.png").exists()
