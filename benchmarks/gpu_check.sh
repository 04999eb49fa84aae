#!/usr/bin/env bash
# The GPU checks issue 6 still owes, as one prepared script for a lent device (15 minutes in all,
# at most 10 per command), so a session that draws one spends its minutes measuring, not typing.
#
#  1. bench_moe_step.py on the GPU at 4K / 65K / 262K tokens per step: the batched experts against
#     the per-expert loop (`moe_dropless_loop`) in the same run; the rows to set beside the
#     2026-12-04 H200 table (7.7-8.6x, measured with the loop) in docs/moe-reproduction.md.
#  2. the EP-64 reproduction (recipes/moe-repro-ep64.yaml: Marin's 64 ranks x 6 experts, 1024
#     measured sequences) for as many steps as EP64_BUDGET_S allows, its per-step records kept.
#
# Prepare here, on the CPU machine (the token shards travel with the working tree via `carry`):
#   python -m workloads.moe data     --config recipes/moe-repro-ep64.yaml --out runs/repro-ep64/data
#   python -m workloads.moe tokenize --config recipes/moe-repro-ep64.yaml --out runs/repro-ep64/tokens
# then one device call, e.g. with carry ["runs/repro-ep64/tokens"] and timeout 590:
#   EP64_BUDGET_S=380 bash benchmarks/gpu_check.sh
# Everything lands in $OUT (the device tool brings that folder back). SKIP_BENCH=1 or SKIP_EP64=1
# leaves a part out; DEVICE=cpu QUICK=1 runs the whole script in a minute here, to check it.
set -uo pipefail

OUT=${OUT:-runs/gpu-check}
PY=${PY:-python}
DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-runs/repro-ep64/tokens}
EP64_BUDGET_S=${EP64_BUDGET_S:-380}
EP64_STEPS=${EP64_STEPS:-300}
EP64_EVERY=${EP64_EVERY:-30}   # a measured step every this many, so a run the time box stops still has its trajectory
mkdir -p "$OUT"
{ date -u; nvidia-smi 2>&1 || echo "no nvidia-smi"; "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if [ "${QUICK:-0}" = 1 ]; then batches="4"; steps=2; else batches="16 256 1024"; steps=20; fi
  for b in $batches; do
    echo "== bench_moe_step --batch $b"
    "$PY" benchmarks/bench_moe_step.py --device "$DEVICE" --steps "$steps" --threads 8 --batch "$b" 2>&1 | tee "$OUT/bench-b$b.md"
  done
fi

if [ "${SKIP_EP64:-0}" != 1 ]; then
  extra=()
  if [ "${QUICK:-0}" = 1 ]; then  # the EP-64 shape on the tiny model: checks the script, not the science
    extra=(--set model.n_layers=1 --set repro.measure_batch_size=64 --set model.context=256
           --set 'repro.transient_steps=[2]' --set 'repro.early_steps=[]' --set repro.late_window=2)
    EP64_STEPS=4
  else
    extra=(--set "repro.transient_steps=[$(seq -s, "$EP64_EVERY" "$EP64_EVERY" "$EP64_STEPS")]")
  fi
  echo "== repro EP-64, $EP64_STEPS steps, stopped after ${EP64_BUDGET_S}s"
  timeout --signal=INT --kill-after=20 "$EP64_BUDGET_S" "$PY" -m workloads.moe repro \
    --config recipes/moe-repro-ep64.yaml --out "$OUT/ep64" --set inputs.tokens="$TOKENS" \
    --set wandb=null --set device="$DEVICE" --set train.steps="$EP64_STEPS" "${extra[@]}" 2>&1 | tail -n 40
  echo "repro exit ${PIPESTATUS[0]} (124: stopped by the time box; metrics.jsonl holds every step it finished)"
  rm -rf "$OUT/ep64/checkpoint"  # too large to bring back; the records are the result
  ls -la "$OUT/ep64" 2>/dev/null
fi
