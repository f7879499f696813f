"""Every command README.md gives a user is checked here, so that a recipe cannot rot unnoticed; so is every command
of the docs pages the README leads to (GUIDES: the detail of the cluster path, operations, planning, models, ...).

Commands come from the README's ```bash blocks and from its inline code that starts a program (``python
...``, ``launchers/...``, ``sudo ...``). Each one is checked by what it is: train.py's overrides compose and
validate (each job of a sweep; a sweep's command line also goes through Hydra's CLI with ``--cfg job``); the
launchers' and workers' arguments go through their own argument parsers (the SLURM worker array through
workers.sbatch itself); the planner runs; modules named without arguments answer ``--help``. A command of a
kind this file does not know fails the test: a new recipe needs a check.

What needs hardware this machine lacks (SLURM, GPUs, the hub) is checked up to the hardware: the SLURM sweep's
worker arrays point at its jobs' coordinator.json files and load the learner's model; local agents get a GPU
each; the rented-box worker's context holds the task's prompts and completions.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from conftest import ROOT, compose
from echo2.config import check_overrides, validate

GUIDES = ("README.md", "docs/cluster.md", "docs/operations.md", "docs/planning.md", "docs/models.md",
          "docs/security.md", "docs/tasks.md", "docs/trl.md", "docs/logging.md")
"""The pages whose commands a user copies: the README and the guides it leads to (generated docs/config.md is not
one: its commands are the experiments' own comments, composed by tests/repo/test_configs.py)."""
README = "\n\n".join((ROOT / page).read_text() for page in GUIDES if (ROOT / page).is_file())
PROGRAM = r"(?:python |\.venv/bin/python |launchers/|sudo |\./install\.sh)"


def readme_commands() -> list[tuple[str, str]]:
    """(where, command line) for each command of the README: block lines (continuations joined, comments
    dropped, ``&&`` chains split) and inline code spans that start a program."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out += [("block", part.strip()) for part in line.split(" && ")]
    for span in re.findall(rf"`({PROGRAM}[^`]*)`", README):
        out.append(("inline", " ".join(span.split())))
    return list(dict.fromkeys(out))  # a command shown twice is checked once


def env_prefix(line: str) -> tuple[str, str]:
    """``VAR=$(...) command ...`` split into the assignment and the command; ("", line) without one."""
    m = re.match(r"([A-Z_][A-Z0-9_]*=\$\([^)]*\))\s+(.*)", line)
    return (m.group(1), m.group(2)) if m else ("", line)


def run_assignment(assignment: str, name: str, tmp_path: Path) -> None:
    """Run ``[export] NAME=$(...)`` as a shell would (``python`` is this interpreter; the run secret is set, as
    on the learner's machine): the command must succeed and print a value of a token's length."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if not (bindir / "python").exists():  # a script, not a symlink: through a symlink in another folder the
        (bindir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # venv is not found
        (bindir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    env.setdefault("ECHO2_TOKEN", "a-run-secret-of-24-chars-or-more")
    out = subprocess.run(["bash", "-c", f"{assignment} && echo \"${name}\""], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and len(out.stdout.strip()) >= 24, out.stderr


class Parsed(Exception):
    pass


def parse_with(main, argv: list[str]) -> argparse.Namespace:
    """The namespace ``main(argv)`` parses its arguments into; it stops right there (nothing starts)."""
    original = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
        try:
            main(argv)
        except Parsed as p:
            return p.args[0]
    raise AssertionError(f"{main.__module__}.main did not parse {argv}")


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job of a ``-m`` sweep (``a=1,2 b=x,y``: 4 jobs), Hydra's own keys left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    mine = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "-"))]
    parsed = OverridesParser.create().parse_overrides(mine)
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [o.input_line] for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


def check_train(args: list[str], world_size: int = 1) -> list:
    """train.py's arguments compose (every job of a sweep) and pass validate(); returns the configs."""
    assert check_overrides(args) == [], args
    jobs = sweep_jobs(args) if "-m" in args else [[a for a in args if not a.startswith(("hydra.", "hydra/"))]]
    cfgs = []
    for job in jobs:
        cfg = compose(job)
        validate(cfg, world_size)
        cfgs.append(cfg)
    return cfgs


def check_hydra_cli(args: list[str]) -> str:
    """A sweep's command line through train.py's CLI, composing only (``--cfg all``: the job's config and Hydra's,
    launcher and sweep dir included), for its first job; returns the output."""
    hydra_args = [a for a in args if a.startswith(("hydra.", "hydra/"))]
    out = subprocess.run([sys.executable, "train.py", *hydra_args, *sweep_jobs(args)[0], "--cfg", "all"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def worker_args(argv: list[str]) -> argparse.Namespace:
    from echo2.worker.agent import main

    return parse_with(main, argv)


def run_stand_in(cmd: list[str], tmp_path: Path, env: dict, curl: str | None = None) -> list[str]:
    """What ``cmd``, run in ``tmp_path``, hands launchers/join.sh (a stand-in there that prints its arguments;
    with ``curl``, a stand-in curl on the PATH that prints it)."""
    stand_ins = [("launchers/join.sh", 'printf "%s\\n" "$@"')] + ([("bin/curl", f"echo {curl}")] if curl else [])
    for name, body in stand_ins:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        os.chmod(tmp_path / name, 0o755)
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}" if curl else os.environ["PATH"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **env, PATH=path))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def run_workers_sbatch(args: list[str], tmp_path: Path) -> list[str]:
    """What launchers/workers.sbatch hands launchers/join.sh."""
    return run_stand_in(["bash", str(ROOT / "launchers" / "workers.sbatch"), *args], tmp_path,
                        {"SLURM_SUBMIT_DIR": str(tmp_path)})


def check(where: str, line: str, tmp_path: Path) -> str:
    """Check one README command; returns how it was checked (a test asserts every kind is exercised)."""
    # Placeholders a reader replaces: N agents/processes, [optional parts] (not a list value, key=[a,b]), "..." for
    # more of the same. Such a line shows a command's form: its fixed part must parse, but it need not run as it
    # stands.
    form = "..." in line or "[" in line
    line = re.sub(r"(?<!=)\[[^\]]*\]", "", line).replace(" N ", " 2 ").replace("...", "").strip()
    if line.startswith("export "):
        name, _, value = line[len("export "):].partition("=")
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), line
        if value.startswith("$("):  # run it: it must print a value
            run_assignment(line, name, tmp_path)
            return "runs"
        return "setup"
    prefix, line = env_prefix(line)
    if prefix:  # VAR=$(...) command: the value must come out of its command, and the command must check
        run_assignment(prefix, prefix.partition("=")[0], tmp_path)
    argv = shlex.split(line, comments=True)
    if argv[0] == "sudo":
        argv = argv[1:]
    if argv[:2] in (["git", "clone"],) or argv[0] == "cd":
        return "setup"
    if argv[0] == "sysctl":
        key, _, value = argv[-1].partition("=")
        assert argv[1] == "-w" and Path("/proc/sys", *key.split(".")).exists() and value, line
        return "parses"
    if argv[0] == "./install.sh":
        assert set(argv[1:]) <= {"--gpu", "--worker", "--env"}, line
        assert all(f"{flag})" in (ROOT / "install.sh").read_text() for flag in argv[1:]), line
        return "parses"
    if argv[0] in ("python", ".venv/bin/python"):
        argv = argv[1:]
    if argv[0] == "train.py":
        check_train(argv[1:])
        if "-m" in argv:
            check_hydra_cli(argv[1:])
        return "composes"
    if argv[:2] == ["-m", "pytest"]:
        return "setup"  # the test suite itself (.ci/run runs it)
    if argv[:2] == ["-m", "echo2.plan"]:

        args = argv[2:]
        if "--plot" in args:
            args[args.index("--plot") + 1] = str(tmp_path / "plan.png")
        if args:
            out = subprocess.run([sys.executable, "-m", "echo2.plan", *args], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert (tmp_path / "plan.png").stat().st_size > 10_000
            return "runs"
        return _help(argv)
    if argv[0] == "-m" and argv[1] in ("echo2.sim", "echo2.report", "echo2.credential", "echo2.export") and len(argv) > 2:
        module = __import__(argv[1], fromlist=["main"])
        parse_with(module.main, argv[2:])
        return "parses"
    if argv[:2] == ["-m", "echo2.eval"] and argv[2:] == ["--help"]:
        from echo2.eval import parse

        with mock.patch("builtins.print"):
            try:
                parse(["--help"])
            except SystemExit as e:
                assert e.code == 0, line
                return "parses"
        raise AssertionError(f"{line}: --help did not exit")
    if argv[:2] == ["-m", "echo2.eval"] and len(argv) > 2:
        from echo2.eval import parse

        checkpoint, task, _ = parse([a for a in argv[2:] if a != "task="] + ([] if "task=" not in argv else
                                                                              ["task=arith"]))  # task=...: a form
        assert checkpoint and task, line
        return "parses"
    if argv[0].startswith("benchmarks/") and argv[0].endswith(".sh"):  # a GPU script: it parses, and says its usage
        out = subprocess.run(["bash", "-n", argv[0]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and f"#   {argv[0]}" in (ROOT / argv[0]).read_text(), (line, out.stderr)
        return "parses"
    if argv[0].startswith("benchmarks/") and len(argv) > 1:  # its options are ones its --help lists
        text = _help_text(argv[:1])
        assert all(a in text for a in argv[1:] if a.startswith("--")), (line, text[-2000:])
        return "parses"
    if argv[0] == "-m" and len(argv) == 2 or argv[0].startswith("benchmarks/") and len(argv) == 1:
        return _help(argv)
    if argv[0] == "launchers/learner.sh":
        if form:
            assert int(argv[1]) and check_overrides(argv[2:]) == []
            return "parses"
        check_train(argv[2:], world_size=int(argv[1]))
        return "composes"
    if argv[0] == "launchers/local.sh":
        n = int(argv[1])
        cfg = check_train(["pool=local", f"pool.workers={n}", *argv[2:]])[0]
        check_local_gpus(cfg, n)
        return "composes"
    if argv[0] == "launchers/join.sh":
        ns = worker_args(["--coordinator", argv[1], *argv[2:]])
        assert ns.coordinator.startswith("http://") or ns.coordinator.startswith("https://") and ns.ca_hash
        return "parses"
    if argv[0] == "sbatch":
        script = next(i for i, a in enumerate(argv) if a.endswith("workers.sbatch"))
        assert all(a.startswith("--") for a in argv[1:script]), line
        joined = run_workers_sbatch(argv[script + 1:], tmp_path)
        worker_args(["--coordinator", *joined])
        return "parses"
    if len(argv) == 1 and argv[0].startswith("launchers/") and argv[0].endswith(".yaml"):  # a file named in prose
        assert (ROOT / argv[0]).is_file(), line
        return "setup"
    if argv[:3] == ["sky", "jobs", "launch"]:
        assert prefix.startswith("ECHO2_TOKEN=$(python -m echo2.credential "), line  # a credential, never the secret
        check_sky_worker(argv[3:], tmp_path)
        return "parses"
    if argv[0].endswith("launchers/wan.py"):
        sys.path.insert(0, str(ROOT / "launchers"))
        try:
            import wan
        finally:
            sys.path.remove(str(ROOT / "launchers"))
        ns = parse_with(wan.main, argv[1:])
        check_train(["pool=static", *ns.train_args])
        return "parses"
    raise AssertionError(f"README command {line!r} ({where}): no check knows it; add one to tests/repo/test_readme.py")


def sky_python() -> str:
    """An interpreter with SkyPilot (requirements-sky.txt) in a virtual environment of its own under the echo2
    cache (SkyPilot's pins clash with vLLM's), built once per version of that file and of echo2's own pins. It sees
    echo2's environment beneath its own (a .pth file), so that pip installs only what SkyPilot lacks there or needs
    at other versions (those shadow echo2's): ~20 s here against ~1 minute for all of its ~100 packages."""
    import site

    from echo2.models.tiny import default_cache_dir

    req = ROOT / "requirements-sky.txt"
    pins = b"".join((ROOT / f).read_bytes() for f in ("requirements-sky.txt", "requirements.txt", "constraints.txt"))
    venv = default_cache_dir() / f"sky-venv-{hashlib.sha256(pins).hexdigest()[:12]}"
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                             capture_output=True, text=True).stdout.strip()
        Path(own, "zz-echo2-environment.pth").write_text(site.getsitepackages()[0] + "\n")  # after its own
        out = subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(req)], capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        (venv / ".complete").touch()
    return str(python)


def check_sky_worker(args: list[str], tmp_path: Path) -> None:
    """``sky jobs launch [options] TASK.yaml --env K=V ... --secret ECHO2_TOKEN``: SkyPilot's own loader reads the
    task with these values (its schema checked); a managed spot job with recovery; its run script, run by bash
    with a stand-in join.sh that prints its arguments (and a stand-in curl for the public address), joins the
    README's coordinator with its CA fingerprint and model, as launchers/join.sh's worker options parse them."""
    path = next(a for a in args if a.endswith(".sky.yaml"))
    envs = [args[i + 1] for i, a in enumerate(args) if a == "--env"]
    secrets = [args[i + 1] for i, a in enumerate(args) if a == "--secret"]
    assert secrets == ["ECHO2_TOKEN"], args  # the credential goes as a secret, not an --env (kept out of logs)
    out = subprocess.run([sky_python(), str(ROOT / "tests" / "scripts" / "sky_task.py"), str(ROOT / path),
                          *[f"--env={e}" for e in envs], "--secret=ECHO2_TOKEN=box:0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    task = json.loads(out.stdout.strip().splitlines()[-1])
    assert task["secrets"] == ["ECHO2_TOKEN"] and task["resources"], task
    for r in task["resources"]:
        assert r["use_spot"] and r["job_recovery"]["strategy"] and r["accelerators"], r
    assert task["setup"].strip() == "./install.sh --worker --gpu"  # the worker only: no TRL, DeepSpeed
    joined = run_stand_in(["bash", "-c", task["run"]], tmp_path, dict(task["envs"], ECHO2_TOKEN="box:0"),
                          curl="203.0.113.7")
    ns = worker_args(["--coordinator", *joined])
    given = dict(e.split("=", 1) for e in envs)
    assert ns.coordinator == given["ECHO2_COORDINATOR"] and ns.ca_hash == given["ECHO2_CA_HASH"], ns
    assert ns.model == given["ECHO2_MODEL"] and ns.engine == "vllm" and ns.dtype == "bfloat16", ns
    assert ns.listen_host == "0.0.0.0" and ns.advertise_host == "203.0.113.7", ns
    for r in task["resources"]:  # the ports the learner and the other workers dial are open: "8702-8703" or "8702"
        spans = [spec.partition("-") for spec in map(str, r["ports"])]
        opened = {p for lo, _, hi in spans for p in range(int(lo), int(hi or lo) + 1)}
        assert {ns.snapshot_port, ns.relay_port} <= opened, (r["ports"], ns)


def _help_text(argv: list[str]) -> str:
    out = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), (argv, out.stderr[-2000:])
    return out.stdout


def _help(argv: list[str]) -> str:
    _help_text(argv)
    return "parses"


def check_local_gpus(cfg, n: int) -> None:
    """launchers/local.sh N on a box with N + 1 GPUs: the learner keeps GPU 0, each agent has one of its own."""
    from hydra.utils import instantiate

    from echo2.learner.sources import pool as pools

    with mock.patch.object(pools, "visible_gpus", lambda: [str(i) for i in range(n + 1)]):
        pool = instantiate(cfg.pool)
    pool.args = {"coordinator_url": "http://127.0.0.1:1", "token": "t", "model_path": "m", "ca_hash": None}
    gpus = [pool.command(i)[1]["CUDA_VISIBLE_DEVICES"] for i in range(n)]
    assert sorted(gpus) == [str(i) for i in range(1, n + 1)] and pool.dtype == "bfloat16"


COMMANDS = readme_commands()


def test_the_readme_has_the_recipes_we_check():
    kinds = {env_prefix(argv)[1].split()[0] for _, argv in COMMANDS}
    assert {"python", "launchers/learner.sh", "launchers/local.sh", "launchers/join.sh", "sbatch", "sky", "sudo",
            "export", "./install.sh"} <= kinds, kinds
    assert len(COMMANDS) >= 30


def starts_a_process(line: str) -> bool:
    """Whether ``check`` runs a program for this command (a shell for ``$(...)``, python for ``--help``, the planner,
    a launcher's stand-in, Hydra's CLI): its test is then an e2e one; composing and parsing run in this process."""
    if "$(" in line:
        return True
    argv = shlex.split(re.sub(r"(?<!=)\[[^\]]*\]", "", line).replace("...", ""), comments=True)
    argv = argv[1:] if argv[:1] in (["python"], [".venv/bin/python"], ["sudo"]) else argv
    return (argv[:1] == ["train.py"] and "-m" in argv or argv[:2] == ["-m", "echo2.plan"]
            or argv[:1] == ["-m"] and len(argv) == 2 or argv[0].startswith("benchmarks/")
            or argv[0] in ("sbatch", "sky"))


@pytest.mark.parametrize("where, line", [pytest.param(w, c, marks=[pytest.mark.e2e] if starts_a_process(c) else [])
                                         for w, c in COMMANDS], ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_readme_command(where, line, tmp_path):
    assert check(where, line, tmp_path) in ("composes", "parses", "runs", "setup")


def _block(marker: str) -> list[str]:
    """The commands of the README block that contains ``marker``."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if marker in b)
    return [ln for ln in re.sub(r"\\\n\s*", " ", block).splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.mark.e2e
def test_slurm_recipe_gives_each_learner_a_model_a_reachable_address_and_its_own_workers(tmp_path):
    """The SLURM block: every learner of the sweep trains the model its workers load, listens beyond loopback on
    ports of its own (free ports, found by the workers in its coordinator.json), and each job has one array."""
    lines = _block("hydra/launcher=slurm")
    learner = shlex.split(next(ln for ln in lines if "train.py" in ln))[2:]
    arrays = [shlex.split(env_prefix(ln)[1]) for ln in lines if env_prefix(ln)[1].startswith("sbatch")]
    # each array joins with a credential of its own, never the run secret (which can sign snapshots)
    assert all(env_prefix(ln)[0].startswith("ECHO2_TOKEN=$(python -m echo2.credential ") for ln in lines
               if env_prefix(ln)[1].startswith("sbatch")), lines
    cfgs = check_train(learner)
    assert len(cfgs) == len(arrays) == 3  # one worker array per learner job
    sweep_dir = next(a.split("=", 1)[1] for a in learner if a.startswith("hydra.sweep.dir="))
    assert "hydra.sweep.subdir=${hydra.job.num}" in learner
    for job, (cfg, array) in enumerate(zip(cfgs, arrays, strict=True)):
        assert cfg.rollout.source._target_.endswith("AsyncRolloutSource") and cfg.pool._target_.endswith("StaticPool")
        assert cfg.rollout.source.host == "0.0.0.0" and cfg.rollout.source.port == 0  # any free port: no clash
        assert cfg.broadcast.sender.host == "0.0.0.0" and cfg.broadcast.sender.port == 0
        assert cfg.task._target_.endswith("Gsm8kTask") and cfg.model.name == "qwen3-4b"
        joined = run_workers_sbatch(array[array.index("launchers/workers.sbatch") + 1:], tmp_path)
        ns = worker_args(["--coordinator", *joined])
        assert ns.coordinator == f"{sweep_dir}/{job}/coordinator.json"
        assert ns.model == cfg.model.path.name_or_path  # the learner's model
        assert ns.engine == "vllm" and ns.dtype == "bfloat16" and ns.listen_host == "0.0.0.0" and ns.advertise_host
        assert ns.max_model_len is None  # the run's need, from coordinator.json
    out = check_hydra_cli(learner)
    assert "staleness: 0" in out or "staleness: 2" in out


@pytest.mark.e2e
def test_a_learner_on_every_interface_advertises_a_reachable_address(tmp_path):
    """What the SLURM recipe relies on: coordinator.json and the snapshot sender name this machine, not 0.0.0.0,
    and a worker given the file finds the learner (real coordinator, real worker process)."""
    import socket

    from conftest import small_coordinator, wait_until
    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.models.identity import model_identity
    from echo2.models.tiny import build_tiny
    from echo2.net import rendezvous

    sender = RelayBroadcaster(secret="t", host="0.0.0.0")
    try:
        assert sender.origin[0] == socket.getfqdn() != "0.0.0.0"
    finally:
        sender.close()
    assert rendezvous.advertised_url("http://0.0.0.0:8700") == f"http://{socket.getfqdn()}:8700"
    model = build_tiny()
    coord = small_coordinator(model)
    coord.requires = {"model": model_identity(model), "max_model_len": 8}
    info = rendezvous.write(str(tmp_path), coord.url, coord.requires)
    assert info["url"] == coord.url and info["max_model_len"] == 8
    worker = subprocess.Popen([sys.executable, "-m", "echo2.worker", "--coordinator", str(tmp_path), "--model",
                               model, "--engine", "hf"], cwd=ROOT, env=dict(os.environ, ECHO2_TOKEN="secret"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: coord.status()["registered"] == 1 or worker.poll() is not None, timeout_s=300)
        assert coord.status()["registered"] == 1
    finally:
        worker.terminate()
        out = worker.communicate(timeout=60)[0]
        coord.close()
    assert f"learner found in {tmp_path}" in out and "context 8 tokens" in out, out[-2000:]


def test_rented_box_worker_context_holds_the_tasks_prompts_and_completions():
    """The rented-GPU recipe's --max-model-len against the learner's task: GSM8K's longest prompt (the local
    fixture, through the same chat template shape) plus task.max_completion_length fits with room to spare."""
    lines = _block("launchers/join.sh https://LEARNER")
    learner = shlex.split(next(ln for ln in lines if "train.py" in ln or ln.startswith("launchers/learner.sh")))[2:]
    worker = shlex.split(next(ln for ln in lines if ln.startswith("launchers/join.sh")))
    cfg = check_train(learner)[0]
    ns = worker_args(["--coordinator", worker[1], *worker[2:]])
    assert ns.model == cfg.model.path.name_or_path
    assert ns.max_model_len >= cfg.task.max_completion_length + 512  # GSM8K questions: well under 512 tokens


OVERRIDES = sorted({o for span in re.findall(r"`([^`\n]+)`", README) for o in [span.strip('"')]
                    if re.fullmatch(r"[+~]?[A-Za-z_][\w.]*(/\w+)?=\S+", o) and "<" not in o})


TYPOS = ("rollout.stalenes=4", "+rollout.stalenes=4", "broadcast.sender.fanuot=3", "rollout.source.liveness.strike=2",
         "learner.num_generations=4")
"""The README's examples of a typo (or a TRL name echo2 spells otherwise) that is refused before anything starts."""


def test_the_readme_names_overrides():
    assert "rollout.source.min_workers=N" in OVERRIDES and len(OVERRIDES) >= 10


@pytest.mark.parametrize("override", OVERRIDES)
def test_readme_override_composes(override):
    """Every ``key=value`` the README's prose offers (N: a number) is an option that composes, except the typos
    it shows failing."""
    override = override.replace("=N", "=2").replace("=μ", "=2")
    if override in TYPOS:
        assert check_overrides([override]), override
        return
    if override.startswith(("hydra.", "hydra/")):
        assert check_overrides([override]) == []
        return
    context = [opt for prefix, opt in CONTEXT.items() if override.startswith(prefix)]
    compose([*context, override])


# Options the README offers inside a group option it names in the same sentence.
CONTEXT = {"learner.deepspeed.": "learner=zero2", "task.data_dir=": "task=gsm8k", "task.environment": "task=dataset"}
