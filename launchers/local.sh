#!/usr/bin/env bash
# The learner plus N worker agents on this machine (the CPU demo, a single GPU box):
#
#   launchers/local.sh 4 experiment=mod10 pool.engine=hf      # 4 agents; any hydra overrides after N
#
# The agents are the run's children (pool=local): started after the coordinator is up, stopped with the run,
# and killed with it if the learner dies. Pin them off the learner's core with pool.cores=[1].
set -euo pipefail
n=${1:?usage: launchers/local.sh N_WORKERS [hydra overrides...]}
shift
cd "$(dirname "$0")/.."
py=${ECHO2_PYTHON:-}
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
exec "$py" train.py pool=local pool.workers="$n" "$@"
