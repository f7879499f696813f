"""The learner and its workers agree or refuse: at registration the coordinator holds the model (name, digest of
config and tokenizer) and the context the run needs; a worker that serves another model, or too short a
context, is told why, exits, and never gets work. Also the clear errors on the way (a hub model without hub
access), and the GPUs local agents get."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from conftest import ROOT, small_coordinator, train, wait_until
from echo2.models.identity import mismatch, model_identity


@pytest.fixture(scope="module")
def other_tiny_dir(echo2_cache) -> str:
    """A second tiny model: same vocabulary, another shape (hidden size 96), so another config digest."""
    from echo2.models.tiny import build_tiny

    return build_tiny(hidden_size=96, intermediate_size=192)


def needs(model_dir: str, max_model_len: int = 8) -> dict:
    return {"model": model_identity(model_dir), "max_model_len": max_model_len}


def test_identity_tells_two_tiny_models_apart_and_a_copy_from_the_original(tiny_model_dir, other_tiny_dir, tmp_path):
    import shutil

    a, b = model_identity(tiny_model_dir), model_identity(other_tiny_dir)
    assert a["digest"] != b["digest"] and a["max_position_embeddings"] == 64
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)  # the same model under another name (a local copy of a hub snapshot)
    assert model_identity(str(copy))["digest"] == a["digest"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # the learner passes its loaded tokenizer: same digest
    assert model_identity(tiny_model_dir, tok) == a


@pytest.mark.parametrize("declared, why", [
    (None, "declared no model"), ({"model": {"name": "x"}}, "declared no model"),
    ({"model": {"name": "other", "digest": "0" * 16}, "max_model_len": 64}, "start the worker with the learner's model"),
    ({"max_model_len": 4}, "its context is 4 tokens, the run needs 8"),
    ({"max_model_len": None}, "its context is None tokens"),
])
def test_mismatch_says_why(tiny_model_dir, declared, why):
    need = needs(tiny_model_dir)
    if declared is not None and "model" not in declared:
        declared = {**declared, "model": need["model"]}
    assert why in mismatch(need, declared)
    assert mismatch(need, {"model": need["model"], "max_model_len": 8}) is None


def _worker(coordinator_url: str, model: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "echo2.worker", "--coordinator", coordinator_url, "--model",
                             model, "--engine", "hf", "--reconnect-timeout-s", "30", *extra], cwd=ROOT,
                            env=dict(os.environ, ECHO2_TOKEN="secret"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_worker_with_another_model_or_a_short_context_is_refused_and_gets_no_work(tiny_model_dir, other_tiny_dir):
    coord = small_coordinator(tiny_model_dir)
    coord.requires = needs(tiny_model_dir, max_model_len=8)
    procs = []
    try:
        wrong = _worker(coord.url, other_tiny_dir)
        short = _worker(coord.url, tiny_model_dir, "--max-model-len", "4")
        procs += [wrong, short]
        out_wrong, _ = wrong.communicate(timeout=300)
        out_short, _ = short.communicate(timeout=300)
        assert wrong.returncode == 2 and "cannot serve this run" in out_wrong, out_wrong[-2000:]
        assert "start the worker with the learner's model" in out_wrong and other_tiny_dir in out_wrong
        assert short.returncode == 2 and "its context is 4 tokens, the run needs 8" in out_short, out_short[-2000:]
        st = coord.status()
        assert st["registered"] == 0 and st["in_flight_groups"] == 0 and coord.ledger.rollouts["dispatched"] == 0
        assert coord.server.rejected["CannotServe"] == 2
        right = _worker(coord.url, tiny_model_dir)  # the learner's model, its full context (64 >= 8): joins
        procs.append(right)
        wait_until(lambda: coord.status()["registered"] == 1 or right.poll() is not None, timeout_s=300)
        assert coord.status()["registered"] == 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
        coord.close()


@pytest.mark.e2e
def test_a_hub_model_without_hub_access_is_one_clear_error(tmp_path):
    """No cache, hub unreachable: the learner's model option and a worker each fail at once, saying what to do."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # port 9: nothing listens
    code = "from echo2.models.hub import from_hub; from_hub('Qwen/Qwen3-0.6B')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "HubUnavailable" in out.stderr
    assert "not in the local Hugging Face cache" in out.stderr and "127.0.0.1:9 is unreachable" in out.stderr
    assert "model.path.name_or_path=DIR" in out.stderr and "Retrying" not in out.stderr
    worker = subprocess.run([sys.executable, "-m", "echo2.worker", "--coordinator", "http://127.0.0.1:1",
                             "--model", "Qwen/Qwen3-0.6B", "--token", "t"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert worker.returncode == 2 and "cannot be downloaded" in worker.stderr and "Traceback" not in worker.stderr


@pytest.mark.parametrize("n, gpus, learners, expect", [
    (3, [], 1, [None, None, None]),                    # CPU
    (2, ["0"], 1, ["0", "0"]),                         # one GPU: learner and agents share it
    (3, ["0", "1", "2", "3"], 1, ["1", "2", "3"]),     # the learner keeps GPU 0
    (4, ["0", "1", "2"], 1, ["1", "2", "1", "2"]),     # more agents than spare GPUs: round-robin
    (2, ["4", "6", "7"], 1, ["6", "7"]),               # CUDA_VISIBLE_DEVICES=4,6,7 upstream: its names
    (4, [str(g) for g in range(8)], 4, ["4", "5", "6", "7"]),  # a 4-process learner keeps 0-3 (LOCAL_WORLD_SIZE)
])
def test_gpu_assignment_for_n_local_agents(n, gpus, learners, expect, monkeypatch):
    from echo2.learner.sources import pool as pools
    from echo2.learner.sources.pool import LocalPool, gpu_assignment

    assert gpu_assignment(n, gpus, learners) == expect
    monkeypatch.setattr(pools, "visible_gpus", lambda: gpus)  # pool.gpus=auto on a box with these GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(learners))
    pool = LocalPool(workers=n, gpus="auto", engine="vllm")
    pool.args = {"coordinator_url": "http://127.0.0.1:1", "token": "t", "model_path": "m"}
    envs = [pool.command(i)[1] for i in range(n)]
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")  # on CPU the pool leaves it as it is
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in envs] == [inherited if g is None else g for g in expect]
    cmd = pool.command(0)[0]
    assert cmd[cmd.index("--dtype") + 1] == ("bfloat16" if gpus else "float32")
    assert "--max-model-len" not in cmd  # null: set by the run from what it needs
    if gpus:  # a list names the agents' own GPUs, used as given
        listed = LocalPool(workers=n, gpus=gpus, engine="vllm")
        listed.args = pool.args
        assert [listed.command(i)[1]["CUDA_VISIBLE_DEVICES"] for i in range(n)] == [gpus[i % len(gpus)]
                                                                                   for i in range(n)]


@pytest.mark.e2e
def test_local_pool_gets_the_context_the_run_needs(tmp_path):
    """pool=local with max_model_len null: the agents are started with the longest prompt + completion length."""
    from conftest import build_run

    _, _, source, _ = build_run(tmp_path, ["rollout=async", "pool=local", "pool.workers=0"])
    try:
        need = source.requires["max_model_len"]
        assert need == 2 + 2  # arith copy: prompts of 2 characters ("7="), task.max_completion_length 2
        assert source.pool.max_model_len == need and source.requires["model"]["digest"]
    finally:
        source.close()


def test_an_engine_failure_is_not_taken_for_an_unreachable_coordinator(tiny_model_dir):
    """vLLM's 4xx is an OSError (requests.HTTPError) from the engine: the agent stops with the engine's error at
    once, instead of retrying it as 'coordinator not reachable' for --reconnect-timeout-s."""
    import requests

    from echo2.worker.agent import Agent, EngineError
    from echo2.records import SamplingParams

    class Failing:
        name, calls = "vllm", 0

        def generate(self, prompts, params):
            self.calls += 1
            raise requests.HTTPError("400 Client Error: Bad Request (prompt longer than max_model_len)")

        def close(self):
            pass

    coord = small_coordinator(tiny_model_dir)
    engine = Failing()
    agent = Agent(coord.url, "secret", engine, reconnect_timeout_s=600)
    try:
        agent.worker_id = agent._register()["worker_id"]
        with pytest.raises(EngineError, match="the vllm engine failed to generate: 400 Client Error"):
            agent._retrying(lambda: agent._step(SamplingParams(n=2, max_tokens=3)))
        assert engine.calls == 1
    finally:
        agent.receiver.close()
        coord.close()


@pytest.mark.e2e
def test_the_wait_line_says_why_a_local_worker_exited(tmp_path):
    """A local agent that exits with an error (here: its engine did not serve a snapshot) is named in the learner's
    waiting lines with its exit code and the last error of its log, not only 'exited'."""
    import subprocess
    import sys

    from echo2.learner.sources.pool import LocalPool

    pool = LocalPool(workers=2, gpus=[])
    pool.log_dir = tmp_path
    (tmp_path / "worker0.log").write_text(
        "[2026-12-03 12:37:26,786][echo2.worker][WARNING] - v67: after apply 2 the probe differs\n"
        "[2026-12-03 12:37:26,787][echo2.worker][ERROR] - the engine does not serve snapshot v67 after two applies\n"
        "[2026-12-03 12:37:27,759][echo2.worker][INFO] - worker stopped\n")
    (tmp_path / "worker1.log").write_text("[2026-12-03 12:37:27,759][echo2.worker][INFO] - still working\n")
    pool.procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
                  subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    try:
        pool.procs[0].wait(timeout=30)
        line = pool.describe("http://127.0.0.1:1")
        assert "exited: worker0 (exit 3: the engine does not serve snapshot v67 after two applies)" in line, line
        assert "worker1" not in line.split("; logs")[0], line
    finally:
        pool.procs[1].kill()
        pool.procs[1].wait()


@pytest.mark.e2e
def test_a_run_whose_local_workers_all_exited_fails_at_once_with_their_error(tmp_path):
    """Every local worker has exited (here: each refused for a context too short for the run), none is connected
    and the coordinator listens on loopback, where no other worker can join: the learner fails within seconds, the
    workers' error in its message, instead of waiting out rollout.source.take_timeout_s for nothing."""
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        train(tmp_path, ["pool.engine=hf", "pool.workers=1", "pool.max_model_len=1", "run.steps=3",
                         "rollout.source.take_timeout_s=240", "rollout.source.wait_log_s=5"])
    message = str(err.value)
    assert "every local worker has exited and no other can join" in message, message
    assert "exited: worker0 (exit 2: " in message and "context" in message, message
    assert time.monotonic() - start < 200, "it waited for the take timeout"
