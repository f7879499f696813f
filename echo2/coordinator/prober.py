"""The probe of each published version, computed beside the coordinator instead of in the learner's step.

    learner step t:  ...optimizer step...  write the snapshot (memory file) ──► publish(t+1, probe pending)
                                           (the learner goes on at once: no forward for the probe)
    broadcaster thread:  _prepare(t+1) ── Prober(blob, probe) ──► probe process (python -m echo2.coordinator.prober FD:
                                                                   the learner's base model, loaded at the first)
                         ◄──────────── logprobs of the probe tokens ─┘
                         sign them into v(t+1)'s manifest, then the relay's round

The probe is the policy's logprobs of fixed tokens, which every worker reproduces before it claims a version
(echo2/models/probe.py). The learner computing it costs a forward of the whole model at every publish, whatever the
snapshot weighs: for a LoRA adapter on a CPU learner that forward is nearly all of the publish (SmolLM2-135M, bf16
base, one core: 0.31 s of a 4.2 s step, against 0.01 s to write the adapter; BENCHMARKS.md, "The probe off the
learner's step"). Here it runs on the coordinator's cores, from the published bytes (SnapshotProbe, below), and the
version reaches the workers that much later instead (0.25 s on a core of its own, 0.54-0.65 s beside a vLLM worker).
``rollout.source.probe_on`` chooses (async_source.PROBE_ON: ``auto`` sends a CPU learner's adapters here).

A probe computed from the snapshot describes what was published (a bf16 snapshot's own rounding included), not the
learner's live weights: a writer that dropped a tensor would go unseen here, where the learner's probe would fail
every worker. What compares the workers' logprobs with the live policy's covers that: the rollout checks
(``check_every_steps``), the importance ratio logged under an off-policy correction (``rollout/is_ratio_*``), and
the fidelity tests; ``rollout.source.probe_on=learner`` puts the probe back on the live weights.

Nothing a stranger sends reaches the probe process: it reads the learner's snapshots only. It leaves the run secret
out of its environment all the same, as the reward processes do. If it fails or hangs, the call is retried once in a
fresh process; a second failure raises, and the broadcaster skips that version (``broadcast/probe_failures``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from echo2.coordinator import child

log = logging.getLogger(__name__)


class Prober:
    """``prober(blob, probe, dtype)``: ``probe`` (a manifest's probe without its logprobs) with them, computed from
    the snapshot ``blob`` in a process holding ``model_path`` in ``dtype`` (the learner's frozen weights' dtype)."""

    def __init__(self, model_path: str, start_timeout_s: float = 300.0, timeout_s: float = 300.0):
        """``start_timeout_s``: loading the model (seconds for SmolLM2-135M, minutes for a large one from a slow
        disk); ``timeout_s``: one probe (loading the snapshot and one forward over a few dozen tokens)."""
        self.model_path, self.start_timeout_s, self.timeout_s = model_path, start_timeout_s, timeout_s
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.dtype: str | None = None
        self.stopped = False  # shutdown(): no process is started again
        self.lock = threading.Lock()

    def __call__(self, blob: Any, probe: dict, dtype: str) -> dict:
        for attempt in (1, 2):
            if self.stopped:
                raise RuntimeError("the coordinator is closing")
            try:
                return {**probe, "logprobs": self._ask(blob, probe["token_ids"], dtype)}
            except Exception as e:
                self.close()
                if attempt == 2:
                    raise
                log.warning("the probe process failed (%s: %s); trying once more in a fresh one", type(e).__name__, e)
        raise AssertionError("unreachable")

    def _ask(self, blob: Any, token_ids: list[int], dtype: str) -> list[float]:
        if self.conn is None or self.dtype != dtype:
            self.close()
            self._start(dtype)
        conn = self.conn
        if conn is None:
            raise RuntimeError("the probe process was closed")
        conn.send_bytes(memoryview(blob))
        conn.send(list(token_ids))
        if not conn.poll(self.timeout_s):
            raise TimeoutError(f"no probe within {self.timeout_s:.0f} s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def _start(self, dtype: str) -> None:
        t0 = time.perf_counter()
        proc, conn = child.spawn("echo2.coordinator.prober")
        with self.lock:
            self.proc, self.conn, self.dtype = proc, conn, dtype
        if self.stopped:  # shut down while this one started: it must not outlive the coordinator
            self.close()
            raise RuntimeError("the coordinator is closing")
        conn.send((self.model_path, dtype))
        if not conn.poll(self.start_timeout_s):
            raise TimeoutError(f"the probe process did not load {self.model_path} within {self.start_timeout_s:.0f} s")
        status, value = conn.recv()
        if status != "ready":
            raise RuntimeError(f"the probe process could not load {self.model_path}: {value}")
        log.info("probe process pid %d: %s in %s, loaded in %.1f s", value, self.model_path, dtype,
                 time.perf_counter() - t0)

    def shutdown(self) -> None:
        """The coordinator closes: the process ends, and none starts again."""
        self.stopped = True
        self.close()

    def close(self) -> None:
        """End the process (the next call starts another). Under a lock: the broadcaster's thread and the closing
        coordinator may both call it, and a socket closed twice could close another one's reused descriptor."""
        with self.lock:
            proc, conn, self.proc, self.conn, self.dtype = self.proc, self.conn, None, None, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()


class SnapshotProbe:
    """The probe computed from a published snapshot's bytes, on a model of its own: what the probe process runs.

    It holds the learner's base model as the learner holds it (``dtype``: the dtype of the learner's frozen
    weights, so that a bf16 base is rounded as the learner's is) and computes in float32 (``float32_compute``), as
    the learner's own probe does. A full snapshot is loaded whole; an adapter snapshot is loaded into PEFT's LoRA
    layers on that base (built at the first one, with the snapshot's rank, alpha and target modules), so the
    forward is the learner's PEFT forward. What it describes is the snapshot as published (its bf16 adapter, its
    bf16 weights), which is what every worker is asked to serve."""

    def __init__(self, model_path: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.model_path, self.dtype = model_path, dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        self.adapted: Any = None  # the PEFT model, from the first adapter snapshot
        self.spec: Any = None

    def __call__(self, blob: Any, token_ids: Sequence[int]) -> list[float]:
        from echo2.broadcast.adapter import spec_of
        from echo2.broadcast.snapshot import decode, metadata
        from echo2.models.probe import float32_compute, probe_logprobs

        spec, tensors = spec_of(metadata(blob)), decode(blob)
        model = self._load_full(tensors) if spec is None else self._load_adapter(spec, tensors)
        with float32_compute(model):
            return probe_logprobs(model, token_ids)

    def _load_full(self, tensors: dict) -> Any:
        if self.adapted is not None:
            raise ValueError("a full snapshot after an adapter one: the probe's model holds a LoRA policy")
        from echo2.models.probe import load_full

        load_full(self.model, tensors, f"a snapshot for {self.model_path}")
        return self.model

    def _load_adapter(self, spec: Any, tensors: dict) -> Any:
        import torch
        from peft import LoraConfig, get_peft_model

        from echo2.broadcast.adapter import saved_name

        if self.adapted is None:
            config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                                use_rslora=spec.use_rslora, lora_dropout=0.0)
            self.adapted, self.spec = get_peft_model(self.model, config).eval(), spec
        elif spec != self.spec:
            raise ValueError(f"adapter {spec} differs from the run's first one ({self.spec})")
        params = {saved: p for n, p in self.adapted.named_parameters() if (saved := saved_name(n)) and ".default." in n}
        if set(params) != set(tensors):
            raise ValueError(f"adapter snapshot does not fit {self.model_path} with {spec}: "
                             f"{sorted(set(params) ^ set(tensors))[:4]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])
        return self.adapted


def _serve(fd: int) -> None:
    """The probe process: load the model named in the first message, then answer (snapshot bytes, token ids) with
    the probe's logprobs until the coordinator closes the socket."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar would cut through the learner's progress bar
    conn = Connection(fd)
    model_path, dtype = conn.recv()
    probe = child.ready(conn, lambda: SnapshotProbe(model_path, dtype))
    if probe is None:
        return
    while True:
        try:
            blob = conn.recv_bytes()
            token_ids = conn.recv()
        except (EOFError, OSError):  # the coordinator closed us, or died
            return
        try:
            conn.send(("ok", probe(blob, token_ids)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="[probe process %(process)d][%(levelname)s] %(message)s")
    _serve(int(sys.argv[1]))
