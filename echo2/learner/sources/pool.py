"""Worker pools: where the worker agents come from.

``LocalPool`` starts N agents on this machine as child processes (the CPU demo and tests); ``StaticPool``
starts nothing and waits for agents started elsewhere (``python -m echo2.worker --coordinator URL``) to join.
Processes are tracked and stopped by their handle, never by name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _child_setup(pin):
    """Runs in the agent's process before exec: pin it (optional) and ask Linux to SIGTERM it when the learner
    dies, even by SIGKILL, so that it stops its engine and leaves instead of retrying a coordinator that is gone."""
    def setup():
        if pin is not None:
            pin()
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return setup


def terminate(procs: list, timeout_s: float = 60.0) -> None:
    """Stop processes we started, by handle: SIGCONT (a stopped one could not act on SIGTERM), SIGTERM, wait up to
    ``timeout_s``, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", p.pid, timeout_s)
            p.kill()
            p.wait()


class StaticPool:
    """Agents are started by someone else (a rented GPU box, a SLURM array) and join, each with its own
    credential (echo2.credential: revocable, and it cannot sign snapshots as the run secret could).
    ``workers`` optionally lists the expected ones with prices and links (for planning: echo2.plan)."""

    def __init__(self, workers: list[dict] | int | None = None):
        # an int is pool=local's agent count, set by an experiment written for it (experiment=smollm2_arith's
        # pool.workers=1) and run with joining workers (launchers/wan.py): nothing to list
        self.workers = [] if isinstance(workers, int) else list(workers or [])

    def start(self, coordinator_url: str, token: str, model_path: str, run_dir: str,
              ca_hash: str | None = None) -> None:
        pin = f" --ca-hash {ca_hash}" if ca_hash else ""
        log.info("waiting for workers to join. Give each worker its own credential, never the run secret: here "
                 "(with the run secret in ECHO2_TOKEN) `python -m echo2.credential NAME` prints NAME's; then on that "
                 "worker's machine run:\n    ECHO2_TOKEN=<NAME's credential> python -m echo2.worker --coordinator "
                 "%s%s --model %s --listen-host 0.0.0.0 --advertise-host <its public address>",
                 coordinator_url, pin, model_path)

    def fit_context(self, tokens: int) -> None:
        """The context the run needs (its longest prompt plus completion): listed workers were started elsewhere,
        with their own; registration refuses one whose context is shorter."""

    def all_exited(self) -> bool:
        """Whether every worker this pool started has exited (never: it starts none)."""
        return False

    def describe(self, coordinator_url: str) -> str:
        """Where this pool's workers come from (for the learner's waiting lines)."""
        return (f"pool=static starts no worker: start them elsewhere with `python -m echo2.worker --coordinator "
                f"{coordinator_url} --model MODEL` (launchers/join.sh), each with its own credential in ECHO2_TOKEN "
                "(`python -m echo2.credential NAME` on this machine), never the run secret")

    def stop(self) -> None:
        pass


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them for a child (none without CUDA)."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:
        return []
    if not count:
        return []
    names = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return names[:count] if names else [str(i) for i in range(count)]


def engine_core(i: int, cores: list[int] | None = None) -> int:
    """The core of local agent i's vLLM (CPU) OpenMP threads, for ``VLLM_CPU_OMP_THREADS_BIND``: ``cores[i mod n]``
    if given, else core i mod the machine's cores. vLLM-CPU binds every engine's threads to core 0 by default, so
    two engines on one machine would spin on one core: the second starved for 25 s in a local pool, and behind the
    WAN launcher it could not apply its first snapshot until the first worker stopped. Pure."""
    return cores[i % len(cores)] if cores else i % (os.cpu_count() or 1)


def gpu_assignment(n_agents: int, gpus: list[str], learner_gpus: int = 1) -> list[str | None]:
    """Each local agent's GPU: the learner's processes keep the first ``learner_gpus``, agents take the others
    round-robin; with none left everyone shares them; with no GPU, None (CPU). Pure."""
    if not gpus:
        return [None] * n_agents
    spare = gpus[learner_gpus:] or gpus
    return [spare[i % len(spare)] for i in range(n_agents)]


class LocalPool:
    def __init__(self, workers: int = 2, engine: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
                 max_groups: int = 4, log_subdir: str | None = "workers", cores: list[int] | None = None,
                 vllm_args: list[str] | None = None, usd_per_hour: float | list[float] = 0.0,
                 gpus: str | list | None = "auto", lora: str = "merge", max_lora_rank: int = 64):
        self.gpus = visible_gpus() if gpus == "auto" else [str(g) for g in (gpus or [])]
        # auto: the learner's processes on this node (one each, launched by accelerate) keep the first GPUs; a list
        # names the agents' own GPUs
        self.learner_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if gpus == "auto" else 0
        self.n, self.engine = workers, engine
        self.dtype = dtype if dtype != "auto" else ("bfloat16" if self.gpus else "float32")
        self.max_model_len, self.max_groups, self.log_subdir = max_model_len, max_groups, log_subdir
        self.log_dir: Path | None = None
        self.cores = list(cores) if cores else None
        self.vllm_args = list(vllm_args or [])
        self.lora, self.max_lora_rank = lora, max_lora_rank
        prices = [usd_per_hour] if isinstance(usd_per_hour, (int, float)) else list(usd_per_hour)
        self.usd_per_hour = [float(x) for x in prices] or [0.0]
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self.args: dict = {}

    def start(self, coordinator_url: str, token: str, model_path: str, run_dir: str,
              ca_hash: str | None = None) -> None:
        self.args = dict(coordinator_url=coordinator_url, token=token, model_path=model_path, ca_hash=ca_hash)
        if len(self.gpus) == 1 and self.n:
            log.warning("one GPU for the learner and %d agents: they share it (set vLLM's memory share with "
                        "pool.vllm_args=[--gpu-memory-utilization=F])", self.n)
        elif len(self.gpus) > 1 and self.n > len(self.gpus) - 1:
            log.warning("%d agents on %d spare GPUs: some share one", self.n, len(self.gpus) - 1)
        self.log_dir = Path(run_dir) / self.log_subdir if self.log_subdir else None
        for _ in range(self.n):
            self.add()

    def command(self, i: int) -> tuple[list[str], dict[str, str]]:
        """Agent i's command line and environment (its GPU, its token)."""
        cmd = [sys.executable, "-m", "echo2.worker", "--coordinator", self.args["coordinator_url"],
               "--model", self.args["model_path"], "--dtype", self.dtype, "--max-groups", str(self.max_groups)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.engine != "auto":
            cmd += ["--engine", self.engine]
        if self.args.get("ca_hash"):  # the run speaks TLS: agents pin its CA
            cmd += ["--ca-hash", self.args["ca_hash"]]
        cmd += [f"--vllm-arg={a}" for a in self.vllm_args]
        if self.lora != "merge":
            cmd += ["--lora", self.lora, "--max-lora-rank", str(self.max_lora_rank)]
        cmd += ["--usd-per-hour", str(self.usd_per_hour[i % len(self.usd_per_hour)])]
        env = dict(os.environ, ECHO2_TOKEN=self.args["token"])
        gpu = gpu_assignment(i + 1, self.gpus, self.learner_gpus)[i]
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return cmd, env

    def add(self) -> subprocess.Popen:
        """Start one more agent (also mid-run: a joining worker)."""
        i = len(self.procs)
        cmd, env = self.command(i)
        core = engine_core(i, self.cores)
        # with pool.cores, worker i is pinned to its core: its agent, its vLLM server and vLLM's OpenMP threads
        pin = (lambda: os.sched_setaffinity(0, {core})) if self.cores else None
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        out = subprocess.DEVNULL
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"worker{i}.log", "ab")
            self._logs.append(out)
            cmd += ["--engine-log", str(self.log_dir / f"worker{i}.engine.log")]
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_child_setup(pin))
        self.procs.append(proc)
        log.info("started local worker %d (pid %d, engine %s, %s)", i, proc.pid, self.engine,
                 f"GPU {env['CUDA_VISIBLE_DEVICES']}" if self.gpus else
                 f"vLLM threads on core {core}{', pinned' if pin else ''}")
        return proc

    def fit_context(self, tokens: int) -> None:
        """The context the run needs (its longest prompt plus completion): agents started here get it, unless
        ``max_model_len`` was set."""
        if self.max_model_len is None:
            self.max_model_len = tokens

    def all_exited(self) -> bool:
        """Whether every worker this pool started has exited (none restarts by itself)."""
        return bool(self.procs) and all(p.poll() is not None for p in self.procs)

    def describe(self, coordinator_url: str) -> str:
        """Where this pool's workers come from, and how the started ones fare (for the learner's waiting lines)."""
        if self.n == 0:
            return "pool=local with pool.workers=0 starts no worker: set pool.workers=N, or join workers yourself"
        dead = [f"worker{i} (exit {p.returncode}{self._last_error(i)})" for i, p in enumerate(self.procs)
                if p.poll() is not None]
        logs = f"; logs in {self.log_dir}/worker*.log" if self.log_dir else ""
        return (f"pool=local started pool.workers={self.n}" + (f", exited: {', '.join(dead)}" if dead else "")
                + logs)

    def _last_error(self, i: int) -> str:
        """The last ERROR line of agent i's log (why it exited), for the learner's waiting lines; '' if none."""
        if not self.log_dir:
            return ""
        try:
            with open(self.log_dir / f"worker{i}.log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in lines if "[ERROR]" in line or line.startswith(("ERROR", "Error"))]
        return f": {errors[-1].split('] - ', 1)[-1].strip()}" if errors else ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM every agent (each stops its own engine), wait, then SIGKILL stragglers."""
        terminate(self.procs, timeout_s)
        for f in self._logs:
            f.close()
