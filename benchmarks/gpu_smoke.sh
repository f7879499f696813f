#!/bin/bash
# GPU smoke checks (BENCHMARKS.md, "GPU smoke checks"): the learner in bf16 on CUDA with the sync source, the same
# learner with two local hf worker agents (async: coordinator, relay broadcast of CUDA weights), and
# benchmarks/step_time.py. Tiny model built locally: no hub access needed.
#   benchmarks/gpu_smoke.sh [OUT_DIR]          (after ./install.sh --gpu, or with the pins on PYTHONPATH)
OUT=${1:-${OUT:-gpu_smoke_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi -L
$PY -c "import torch,transformers,trl,accelerate;print('versions torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available())"
A="run.wandb=disabled run.progress=false run.eval_every_steps=0 learner.bf16=true"
RUNS=$(mktemp -d)
t0=$(date +%s)
timeout 150 $PY train.py rollout=sync run.steps=40 $A hydra.run.dir=$RUNS/sync > "$OUT/sync.log" 2>&1; echo "sync rc=$? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 200 $PY train.py rollout=async pool=local pool.engine=hf pool.workers=2 run.steps=30 $A hydra.run.dir=$RUNS/async \
    > "$OUT/async.log" 2>&1; echo "async rc=$? in $(( $(date +%s) - t0 )) s"
for n in sync async; do cp "$RUNS/$n/summary.json" "$OUT/${n}_summary.json"; cp "$RUNS/$n/metrics.jsonl" "$OUT/${n}_metrics.jsonl"; done
grep -h "learner Echo2" "$OUT/sync.log" "$OUT/async.log"
$PY - "$RUNS" <<'PY'
import json, statistics, sys
for name in ("sync", "async"):
    recs = [json.loads(line) for line in open(f"{sys.argv[1]}/{name}/metrics.jsonl") if line.strip()]
    s = json.load(open(f"{sys.argv[1]}/{name}/summary.json"))
    r = [x["reward/mean"] for x in recs if "reward/mean" in x]
    st = [x["train/step_time_s"] for x in recs if "train/step_time_s" in x]
    print(name, "steps", s["steps"], "wall", round(s["wall_s"], 1), "reward first5", round(statistics.fmean(r[:5]), 3),
          "last5", round(statistics.fmean(r[-5:]), 3), "median step s", round(statistics.median(st), 4),
          "accounting", json.dumps(s["rollout_accounting"]))
PY
t0=$(date +%s)
timeout 150 $PY benchmarks/step_time.py > "$OUT/step_time.txt" 2>&1; echo "step_time rc=$? in $(( $(date +%s) - t0 )) s"
tail -5 "$OUT/step_time.txt"
# vLLM workers (where the CUDA build of vLLM is installed; it cannot be carried to a machine without network):
# on-policy logprobs equal the learner's after every in-memory apply, tied and untied, with CUDA graphs on; and
# the async run with two vLLM agents.
if $PY -c "import vllm" 2>/dev/null; then
  t0=$(date +%s)
  timeout 400 $PY -m pytest tests/worker/test_engines.py -q -k vllm > "$OUT/vllm_engines.txt" 2>&1; echo "vllm engines rc=$? in $(( $(date +%s) - t0 )) s"
  tail -3 "$OUT/vllm_engines.txt"
  t0=$(date +%s)
  timeout 400 $PY train.py rollout=async pool=local pool.engine=vllm pool.workers=2 run.steps=30 $A \
      hydra.run.dir=$RUNS/vllm > "$OUT/vllm_async.log" 2>&1; echo "vllm async rc=$? in $(( $(date +%s) - t0 )) s"
  grep -h "applied snapshot" "$RUNS"/vllm/workers/*.log | tail -2
else
  echo "vllm is not installed here: the vLLM worker checks did not run"
fi
