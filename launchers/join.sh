#!/usr/bin/env bash
# Join a running learner from any machine (a rented GPU box, a SLURM array task): one worker agent.
#
#   export ECHO2_TOKEN=<this worker's credential>   # python -m echo2.credential NAME on the learner (never argv)
#   launchers/join.sh https://LEARNER_HOST:PORT --ca-hash sha256:... --model Qwen/Qwen3-4B [worker options]
#   (the learner prints the URL and the run CA's fingerprint when it starts)
#
# First time on a box: sets up the worker's own environment, .venv-worker, with ./install.sh --worker (--gpu where
# nvidia-smi sees a GPU: vLLM and echo2's worker package, not the learner's TRL or DeepSpeed), once even when many
# tasks of an array start together in one shared checkout. A multi-turn task (an environment or tools run on the
# worker): export ECHO2_WORKER_ENV=1 first, and the install adds their packages (./install.sh --worker --env). A full
# install (.venv, ./install.sh) serves too, where there is one; $ECHO2_PYTHON: use that interpreter, install nothing.
# Every option after the URL goes to `python -m echo2.worker` (--help lists them: --engine, --dtype,
# --max-model-len, --usd-per-hour, --advertise-host, --snapshot-port, --relay-port, --vllm-arg ...). The learner must reach this box's snapshot
# port, and other workers its relay port: on a rented box open both and pass --advertise-host <public IP>.
set -euo pipefail
url=${1:?usage: launchers/join.sh https://LEARNER:PORT --ca-hash sha256:... [--model M] [worker options]}
shift
cd "$(dirname "$0")/.."
: "${ECHO2_TOKEN:?export ECHO2_TOKEN first: the credential of this worker for the run to join}"
py=${ECHO2_PYTHON:-}
if [ -z "$py" ] && [ -f .venv/.echo2-installed ]; then
  py=.venv/bin/python
elif [ -z "$py" ]; then
  py=.venv-worker/bin/python
  # Many array tasks may share this checkout: one installs (under a lock), the others wait and then use it.
  exec 9>.venv.install.lock
  flock 9
  if [ ! -f .venv-worker/.echo2-installed ]; then
    gpu=
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=--gpu; fi
    env=; [ "${ECHO2_WORKER_ENV:-0}" = 1 ] && env=--env
    ECHO2_VENV=.venv-worker ./install.sh --worker $env $gpu
  fi
  flock -u 9
fi
exec "$py" -m echo2.worker --coordinator "$url" "$@"
