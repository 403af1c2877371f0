#!/usr/bin/env bash
# Reproduces the CPU column of README.md's table: short runs on the synthetic set.
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
# ROWS picks rows by config name (default: the five precision rows); the ZeRO rows are
# zero1 zero2 zero3 gemini (two data-parallel ranks each, as the DP rows)
ROWS=${ROWS:-"single fp32 torch_fp16 naive_fp16 bf16"}
declare -A NAME=([single]="single fp32" [fp32]="DP fp32" [torch_fp16]="DP torch fp16"
  [naive_fp16]="DP naive fp16" [bf16]="DP bf16" [zero1]="ZeRO 1" [zero2]="ZeRO 2"
  [zero3]="ZeRO 3" [gemini]="Gemini (ZeRO 3 + offload)")
for row in $ROWS; do
  if [ "$row" = single ]; then run "${NAME[$row]}" 1 fp32; else run "${NAME[$row]}" 2 "$row"; fi
done
