#!/usr/bin/env bash
# Multi-process learner through `accelerate launch`, e.g. DeepSpeed ZeRO-2 on 2 processes:
#
#   launchers/learner.sh 2 learner=zero2 [more hydra overrides]
#
# With remote rollouts (rollout=async, the default) rank 0 alone starts the coordinator and the worker pool and
# hands every rank its slice of each batch. N must divide rollout.prompts_per_step (whole groups per rank).
#
# On CPU the processes talk over gloo; on a GPU node use one process per GPU. The DeepSpeed settings
# come from the learner config (learner/zero2.yaml, zero3.yaml), not from an accelerate config file, so
# they stay overridable from the command line. All ranks share one run directory (rank 0 writes it).
set -euo pipefail
nproc=${1:?usage: launchers/learner.sh NPROC [hydra overrides...]}
shift
cd "$(dirname "$0")/.."
run_dir=${ECHO2_RUN_DIR:-outputs/$(date +%Y-%m-%d)/$(date +%H-%M-%S)-np${nproc}}
port=${MASTER_PORT:-$((29500 + RANDOM % 1000))}

# The environment to run in: $ECHO2_PYTHON, else ./install.sh's .venv, else python3 on PATH.
py=${ECHO2_PYTHON:-}
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
# Each python environment gets its own cache of DeepSpeed's JIT-built ops (shared caches rebuild on every switch).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$("$py" -c 'import sys; print(sys.prefix)')/torch_extensions}
exec "$py" -m accelerate.commands.launch --use_deepspeed --num_processes "$nproc" --num_machines 1 --machine_rank 0 \
  --main_process_port "$port" --mixed_precision no --dynamo_backend no \
  train.py hydra.run.dir="$run_dir" "$@"
