#!/bin/bash
# A LoRA learner against full fine-tuning on one GPU (BENCHMARKS.md, "LoRA"): a model of Qwen3-0.6B's shape (random
# weights, built locally: no hub), the bf16 learner on CUDA (fp32 master weights), async S = 2 from one local hf
# worker agent on the same GPU, 20 steps each way; per run the median step time, the learner's and the worker's
# peak GPU memory (nvidia-smi, sampled every 0.5 s), what each snapshot weighed and how long the worker took to apply
# it. Made to finish well inside 10 minutes on one H200.
#   benchmarks/gpu_lora.sh [OUT_DIR]            (after ./install.sh --gpu, or with the pins on PYTHONPATH)
#   LAYERS=2 STEPS=3 benchmarks/gpu_lora.sh     (a quick check of the script itself, also on a CPU)
OUT=${1:-${OUT:-gpu_lora_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-28}
STEPS=${STEPS:-20}
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c "import torch,transformers,trl,peft;print('versions torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
SHAPE="model=tiny model.name=qwen3-0.6b-shape model.path.vocab_size=151936 model.path.hidden_size=1024
 model.path.intermediate_size=3072 model.path.num_attention_heads=16 model.path.num_key_value_heads=8
 model.path.head_dim=128 model.path.tie_word_embeddings=true model.path.num_hidden_layers=$LAYERS
 model.path.max_position_embeddings=128"
A="rollout=async pool=local pool.engine=hf pool.workers=1 rollout.staleness=2 broadcast.interval=1 learner.bf16=true
 run.steps=$STEPS run.eval_every_steps=0 run.save_every_steps=0 run.wandb=disabled run.progress=false"
RUNS=$(mktemp -d)
for mode in full lora; do
  EXTRA="learner.learning_rate=1e-5"
  [ "$mode" = lora ] && EXTRA="learner.learning_rate=1e-4 learner.lora.rank=8"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 500 > "$OUT/${mode}_gpu_memory.csv" &
    SMI=$!
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 280 $PY train.py $SHAPE $A $EXTRA hydra.run.dir=$RUNS/$mode > "$OUT/$mode.log" 2>&1
  echo "$mode rc=$? in $(( $(date +%s) - t0 )) s"
  [ -n "${SMI:-}" ] && kill $SMI 2>/dev/null
  cp "$RUNS/$mode/metrics.jsonl" "$OUT/${mode}_metrics.jsonl" 2>/dev/null
  grep -h "applied snapshot" "$RUNS/$mode"/workers/*.log | tail -3 > "$OUT/${mode}_applies.txt" 2>/dev/null
done
grep -h "learner Echo2" "$OUT/full.log" "$OUT/lora.log"
$PY - "$RUNS" "$OUT" <<'PY'
import csv, json, re, statistics, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
for mode in ("full", "lora"):
    recs = [json.loads(line) for line in (runs / mode / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["train/step_time_s"] for r in recs[2:] if "train/step_time_s" in r]  # the first steps warm up
    publish = [r.get("train/publish_s") or 0.0 for r in recs[2:]]
    sizes = [r["broadcast/bytes"] for r in recs if r.get("broadcast/bytes")]
    applies = re.findall(r"\(([\d.]+) MB\) in ([\d.]+) s", (out / f"{mode}_applies.txt").read_text())
    peak = {}
    smi = out / f"{mode}_gpu_memory.csv"
    if smi.exists():
        for row in csv.reader(smi.read_text().splitlines()):
            if len(row) == 2 and row[1].strip().isdigit():
                peak[row[0].strip()] = max(peak.get(row[0].strip(), 0), int(row[1]))
    print(mode, "steps", len(recs), "median step s", round(statistics.median(steps), 4) if steps else None,
          "publish s", round(statistics.median(publish), 4) if publish else None,
          "snapshot MB (worker log)", applies[-1][0] if applies else None, "apply s", applies[-1][1] if applies else None,
          "broadcast bytes", sizes[-1] if sizes else None, "peak GPU MiB by pid", peak)
PY
