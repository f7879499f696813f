"""Shared test setup: no hub, no wandb network, one OpenMP thread, a per-session model cache.

The tree mirrors the package (tests/learner/ for echo2/learner/, ...); tests/e2e/ holds whole-system runs, and
tests/repo/ what a user meets first (configs, the CLI, launchers, the README, the docs). Shrunk knobs are commented
where they are set. Markers: ``e2e`` on every test that starts an operating-system process (a test that starts one
without the marker fails, naming what it started: ``-m "not e2e"`` stays the quick loop), ``slow`` (> ~30 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# trackio keeps its projects in $TRACKIO_DIR (read once, at its import): the tests' runs go to a folder of their own
os.environ.setdefault("TRACKIO_DIR", os.path.join(tempfile.gettempdir(), f"echo2-tests-trackio-{os.getuid()}"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from echo2.env import descendants  # noqa: E402, F401  (the tests' process-tree helper)


E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config, items):
    for item in items:  # everything in tests/e2e/ is a whole-system run
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


RUNS_SOMETHING = re.compile(r"python[\d.]*|torchrun|accelerate|deepspeed|bash|sh|ip|iptables|iperf3|tc|sbatch|srun|sky|"
                            r"vllm|.*\.sh")
"""Programs whose start makes a test an e2e one: an interpreter (train.py, an agent, vLLM, a coordinator or reward
process), a launcher, the network tools of the WAN testbed. Not the queries libraries make of the machine
(``platform.processor()`` runs ``uname -p``, ``platform.architecture()`` runs ``file``; the docs tests ask git)."""


@pytest.fixture(autouse=True)
def processes_only_in_e2e(request, monkeypatch):
    """A test not marked ``e2e`` that starts an operating-system process fails at its end, naming the command: the
    marker is what keeps ``-m "not e2e"`` quick, so it must not be forgotten. The process itself is started as
    asked (refusing it inside library code could be swallowed and read as another failure)."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    import multiprocessing.process

    started: list[str] = []
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self, args, *a, **kw):
        argv = [str(x) for x in args] if isinstance(args, (list, tuple)) else str(args).split()
        if argv and RUNS_SOMETHING.fullmatch(os.path.basename(argv[0])):
            started.append(" ".join(argv))
        popen_init(self, args, *a, **kw)

    def start(self):
        started.append(f"multiprocessing {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    yield
    if started:
        pytest.fail(f"this test started {len(started)} process(es) without the e2e marker (first: "
                    f"{started[0][:200]}): mark it @pytest.mark.e2e", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def echo2_cache(tmp_path_factory) -> Path:
    """One model cache for the whole session (the tiny model is built once), unless the caller set one."""
    if "ECHO2_CACHE_DIR" not in os.environ:
        os.environ["ECHO2_CACHE_DIR"] = str(tmp_path_factory.mktemp("echo2-cache"))
    return Path(os.environ["ECHO2_CACHE_DIR"])


@pytest.fixture(scope="session")
def tiny_model_dir(echo2_cache) -> str:
    from echo2.models.tiny import build_tiny

    return build_tiny()


@pytest.fixture
def worker_tmp(tmp_path, monkeypatch) -> Path:
    """The temporary folder of the processes this test starts (they inherit TMPDIR): to check what they leave."""
    path = tmp_path / "worker-tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    return path


def compose(overrides: list[str] | None = None):
    """The config ``python train.py OVERRIDES`` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from echo2.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


def run_train(args: list[str], run_dir: Path, timeout: float = 600, launcher: list[str] | None = None):
    """Run ``train.py`` (or a launcher) as a user would, in a subprocess; return the CompletedProcess."""
    cmd = (launcher or [sys.executable, "train.py"]) + list(args)
    env = dict(os.environ, ECHO2_RUN_DIR=str(run_dir), ECHO2_PYTHON=sys.executable)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def closed_by_server(sock, timeout_s: float) -> bool:
    """Whether the server closed ``sock`` within ``timeout_s`` (what it sent before closing is skipped)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def build_run(tmp_path, overrides: list[str]):
    """Compose and build a run in this process, as train.py would; returns (cfg, trainer, source, callback), where
    ``source`` is the run's own rollout source (a remote one without the one-rank ShardedSource around it)."""
    import train
    from echo2.learner.distributed import ShardedSource

    cfg = compose(["run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0", *overrides])
    trainer, source, step_log = train.build(cfg, str(tmp_path), rank=0, world_size=1)
    return cfg, trainer, source.source if isinstance(source, ShardedSource) else source, step_log


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def small_coordinator(tiny_model_dir: str, group_size: int = 2, **kwargs):
    """A started in-process Coordinator on a 20-row copy task: S = 1, P = 2, no long polls (route tests)."""
    from transformers import AutoTokenizer

    from echo2.coordinator.coordinator import Coordinator
    from echo2.scoring import Scorer
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.arith import ArithTask

    task = ArithTask(level="copy", train_size=20)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    broadcaster = kwargs.pop("broadcaster", None)
    eval_rows = kwargs.pop("eval_rows", None)  # held-out rows workers evaluate (run.eval_on=workers)
    token = kwargs.pop("token", "secret")  # an exposed coordinator (host off loopback) needs a strong one
    settings = CoordinatorSettings(token=token, staleness=1, prompts_per_step=2, group_size=group_size,
                                   vocab_size=len(tok), long_poll_s=0.0,
                                   sampling={"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0}, **kwargs)
    return Coordinator(task.train_dataset(), Scorer(task, tok), tok, settings, broadcaster, eval_rows=eval_rows).start()


# ---------------------------------------------------------------------- asynchronous runs in this process


def _at_step(fn, source):
    """A trainer callback running ``fn(step, source)`` after each optimizer step (to kill or add workers)."""
    from transformers import TrainerCallback

    class AtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            fn(state.global_step, source)

    return AtStep()


def train(tmp_path, overrides, hook=None):
    """Build and train an async run in this process with local workers; ``hook(step, source)`` after each step.
    Returns (cfg, trainer, source, accounting, per-step records)."""
    cfg, trainer, source, callback = build_run(tmp_path, ["rollout=async", "pool=local", *overrides])
    if hook:
        trainer.add_callback(_at_step(hook, source))
    try:
        trainer.train()
    finally:
        acc = source.close()
    records = [h for h in trainer.state.log_history if "reward/mean" in h]
    return cfg, trainer, source, acc, records


def balanced(acc):
    """The accounting identity, with nothing left in flight or buffered at the end."""
    total = acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
    return acc["dispatched"] == total + acc["in_flight"] + acc["buffered"] and acc["in_flight"] == acc["buffered"] == 0


def holds_within(cond, timeout=20.0) -> bool:
    """Whether ``cond()`` comes true within ``timeout`` seconds (polled every 20 ms); for ``assert holds_within(...)``
    where the condition's own failure message says enough."""
    import time

    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def wait_until(condition, timeout_s=300, what: str | None = None):
    """Wait (we may be holding the learner in its callback) until ``condition()``; a starting vLLM takes 25-60 s here.

    Fails the test, naming ``what`` (default: the condition's source line), if it has not come true in time:
    a test must not go on as if it had."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or _source_of(condition)}")
        time.sleep(0.5)


def _source_of(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn).strip()
    except (OSError, TypeError):
        return repr(fn)


def wait_registered(source, n, timeout_s=300):
    wait_until(lambda: source.coordinator.status()["registered"] >= n, timeout_s,
               what=f"{n} workers registered with the coordinator")


def delivered_by(source, *workers: str) -> bool:
    by_worker = source.coordinator.status()["by_worker"]
    return all(by_worker.get(w, 0) > 0 for w in workers)


def slow_until(condition, at_most_s: float = 1.0) -> bool:
    """From a step hook: give ``condition`` up to ``at_most_s`` to come true, then let the step go on; says whether it
    did. For a worker that joins late and must deliver before the run ends: it registers before it has loaded its
    model and the first snapshot, and a short run can end first (CI runs did). Not a hold, which would not help: a
    held learner consumes nothing, so a full buffer dispatches nothing new; a slowed one goes on consuming."""
    import time

    until = time.monotonic() + at_most_s
    while not condition():
        if time.monotonic() >= until:
            return False
        time.sleep(0.1)
    return True


class WrappedSource:
    """A stub rollout source: another source's rollouts (``collect`` overridden to change them), nothing else."""

    check_every_steps = 0

    def __init__(self, inner):
        self.inner, self.needs_policy = inner, True

    def collect(self, rows, version, policy=None):
        return self.inner.collect(rows, version, policy)

    def on_version(self, version, policy):
        pass

    def metrics(self):
        return {}

    def checkpoint(self, kept=None):
        return {}

    def on_resume(self, version, policy):
        pass

    def close(self):
        pass


def post_with_credentials(host: str, port: int, path: str, body: dict, credentials) -> tuple[int, dict]:
    """POST with one ``Authorization`` header per credential, in that order (requests would merge them)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=10)
    data = json.dumps(body).encode()
    conn.putrequest("POST", path)
    for c in credentials:
        conn.putheader("Authorization", f"Bearer {c}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"{}")
    conn.close()
    return out


class ScriptedEngine:
    """The learner's engine interface (generate(policy, ids, params)) over a scripted policy."""

    def __init__(self, policy):
        self.policy = policy

    def generate(self, policy, prompt_ids, params, greedy=False):
        return self.policy.generate(prompt_ids, params)
