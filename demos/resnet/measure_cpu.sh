#!/usr/bin/env bash
# Reproduces the CPU column of README.md's table: five short runs on the synthetic set.
# Usage: demos/resnet/measure_cpu.sh [extra train.py args], from the repository root.
set -euo pipefail
BIN=${BIN:-.venv/bin}
export OMP_NUM_THREADS=1  # one thread per process: oversubscribed threads crawl on shared cores
ARGS=(--synthetic --train_size 500 --test_size 250 --epochs 2 -i 0 --no_progress "$@")
run() {  # name, nproc, config
  echo "== $1"
  if [ "$2" = 1 ]; then
    "$BIN/python" demos/resnet/train.py --config "demos/resnet/configs/$3.py" "${ARGS[@]}"
  else
    "$BIN/gridtrain" run --nproc_per_node "$2" --config "demos/resnet/configs/$3.py" \
      demos/resnet/train.py "${ARGS[@]}"
  fi 2>&1 | grep -E "epoch|accuracy|Error|error" || true
}
run "single fp32" 1 fp32
run "DP fp32" 2 fp32
run "DP torch fp16" 2 torch_fp16
run "DP naive fp16" 2 naive_fp16
run "DP bf16" 2 bf16
