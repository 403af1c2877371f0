#!/usr/bin/env bash
# The demos/hf_finetune README table for one model: every layout, CPU processes (gloo).
# Usage: scripts/hf_demo_table.sh gpt2|llama [WORKDIR]; the dp run pre-trains first.
# CONFIGS="dp:2 pp:2" picks layouts (name:processes; keep dp first: it pre-trains).
set -uo pipefail
MODEL=$1
WORK=${2:-/tmp/hf_demo_$MODEL}
PY=${PY:-python3}
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""  # CPU processes even on a GPU machine
rm -rf "$WORK" && mkdir -p "$WORK"
for cfg in ${CONFIGS:-dp:2 1d:2 2d:4 3d:8 sequence:2 pp:2 hybrid:8}; do
  name=${cfg%%:*} n=${cfg##*:}
  echo "== $MODEL $name ($n processes)"
  "$PY" -m gridtrain.cli run --nproc_per_node "$n" --config "demos/hf_finetune/configs/$name.py" \
    demos/hf_finetune/finetune.py --model_type "$MODEL" --pretrained_path "$WORK/pre" \
    --save_path "$WORK/ft_$name" 2>&1 | grep -E "fine-tuned|accuracy|Error|FAILED|saved the pre" || true
done
