"""The engine guard (echo2.worker.engines.guard): a vLLM server cannot outlive its worker agent, and neither can
the engine's work folder. A sleeping process stands in for the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, alive, descendants, wait_until


def start_agent(tmp_path, workdir):
    """A stand-in agent: it starts the guard over a stand-in server (which writes its pid) and waits."""
    pidfile = tmp_path / "server.pid"
    server = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    agent_src = (f"import subprocess, sys, time\n"
                 f"subprocess.Popen([sys.executable, '-m', 'echo2.worker.engines.guard', '--remove', "
                 f"{str(workdir)!r}, sys.executable, '-c', {server!r}])\n"
                 f"time.sleep(600)\n")
    agent = subprocess.Popen([sys.executable, "-c", agent_src], cwd=ROOT)
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text(), timeout_s=60, what="the stand-in server to start")
    except BaseException:
        stop_all(descendants(agent.pid) | {agent.pid})
        agent.wait()
        raise
    return agent, int(pidfile.read_text())


def stop_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e
def test_an_agent_killed_by_sigkill_takes_its_server_and_work_folder_with_it(tmp_path):
    workdir = tmp_path / "echo2-weights-x"
    workdir.mkdir()
    (workdir / "vllm.log").write_text("a log the dead agent cannot remove\n")
    agent, server = start_agent(tmp_path, workdir)
    family = descendants(agent.pid)
    try:
        assert server in family
        agent.kill()
        agent.wait()
        wait_until(lambda: not any(alive(p) for p in family), timeout_s=30, what="the guard and server to exit")
        assert not workdir.exists()
    finally:
        stop_all(family)


@pytest.mark.e2e
def test_an_orderly_stop_leaves_the_work_folder_to_the_agent(tmp_path):
    """SIGTERM to the guard while its agent lives (the agent's engine.close()): the server stops, and the folder
    stays for the agent, which removes it itself after reading the log."""
    workdir = tmp_path / "echo2-weights-y"
    workdir.mkdir()
    agent, server = start_agent(tmp_path, workdir)
    family = descendants(agent.pid)
    guard = next(p for p in family if p != server)
    try:
        os.kill(guard, signal.SIGTERM)
        wait_until(lambda: not alive(server) and not alive(guard), timeout_s=30, what="the guard to stop its server")
        assert workdir.exists() and alive(agent.pid)
    finally:
        agent.kill()
        agent.wait()
        stop_all(family)
