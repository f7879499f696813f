"""``python -m echo2.worker.engines.guard CMD ...``: run CMD so that it cannot outlive whoever started us.

CMD (a vLLM server) runs in its own process group. The guard takes the whole group down (SIGTERM, then
SIGKILL after a grace period, since a vLLM server still starting up ignores SIGTERM) when

* it gets SIGTERM / SIGINT itself (an orderly stop by the agent), or
* its parent, the worker agent, dies — even by SIGKILL, when no handler of the agent runs: the guard polls
  its parent pid. (``PR_SET_PDEATHSIG`` alone proved unreliable here: a killed agent left a running server.)

``--remove DIR`` before CMD: once the group is down after its parent died, the guard also removes DIR (the
engine's work folder, which the dead agent can no longer remove).

It exits with CMD's exit status.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

GRACE_S = 15.0


def stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:  # stragglers: a server that ignored SIGTERM, or engine children of a leader that did exit
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    parent, cmd, remove = os.getppid(), sys.argv[1:], None
    if cmd[:1] == ["--remove"]:
        remove, cmd = cmd[1], cmd[2:]
    proc = subprocess.Popen(cmd, start_new_session=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    while proc.poll() is None:
        if stopping or os.getppid() != parent:
            stop_group(proc)
            break
        time.sleep(0.5)
    if remove and os.getppid() != parent:
        shutil.rmtree(remove, ignore_errors=True)
    sys.exit(proc.returncode if proc.returncode is not None and proc.returncode >= 0 else 1)


if __name__ == "__main__":
    main()
