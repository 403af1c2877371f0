#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md on a one-GPU machine, in parts that each fit a
# 10-minute window: `scripts/h200_runs.sh a|b|c|d|e|f|g|h|i|j|k|l OUTDIR`. GPU work is pinned to cores 0-3; CPU
# tables (gloo processes) run meanwhile on the other cores.
set -uo pipefail
PART=$1
OUT=${2:-/tmp/h200_out}
mkdir -p "$OUT"
PY=${PY:-python3}
GPU="taskset -c 0-3"
CPUS="taskset -c 4-$(($(nproc) - 1))"
nvidia-smi -L; $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
git log --oneline -1
if [ "$PART" = a ]; then  # the tables, then GPT-2 throughput against plain PyTorch
  $CPUS bash scripts/hf_demo_table.sh gpt2 >"$OUT/hf_demo_gpt2.log" 2>&1 &
  $CPUS bash scripts/hf_demo_table.sh llama >"$OUT/hf_demo_llama.log" 2>&1 &
  $GPU timeout 400 $PY benchmarks/gpt_throughput.py --compile --fast --rounds 2 >"$OUT/gpt.log" 2>&1
  $GPU timeout 120 $PY benchmarks/hf_throughput.py >"$OUT/hf_throughput.log" 2>&1
  wait
elif [ "$PART" = b ]; then  # make test-gpu, the throughput targets
  $GPU timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu >"$OUT/test_gpu.log" 2>&1
  $GPU timeout 300 $PY benchmarks/gpt_throughput.py --compile --fast --rounds 2 >"$OUT/gpt.log" 2>&1
  $GPU timeout 100 $PY benchmarks/hf_throughput.py >"$OUT/hf_throughput.log" 2>&1
  wait
elif [ "$PART" = e ]; then  # GPU only, nothing else on the host: batch, ZeRO, ResNet, MoE profile
  $GPU timeout 220 $PY benchmarks/largest_batch.py >"$OUT/largest.log" 2>&1
  $GPU timeout 100 $PY benchmarks/zero_memory.py throughput >"$OUT/zero.log" 2>&1
  $GPU timeout 80 $PY benchmarks/resnet_throughput.py --steps 20 --repeats 3 >"$OUT/resnet.log" 2>&1
  $GPU timeout 90 $PY scripts/profile_moe.py >"$OUT/moe_profile.log" 2>&1
elif [ "$PART" = f ]; then  # GPU only: MoE eager and compiled, its profile, ZeRO 1/2 speed, ResNet
  $GPU timeout 60 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_moe.py >"$OUT/test_moe.log" 2>&1
  {
    $GPU timeout 80 $PY benchmarks/moe_throughput.py --device cuda --rounds 3
    $GPU timeout 150 $PY benchmarks/moe_throughput.py --device cuda --rounds 3 --compile --dispatch grouped
  } >"$OUT/moe.log" 2>&1
  $GPU timeout 60 $PY scripts/profile_moe.py >"$OUT/moe_profile.log" 2>&1
  $GPU timeout 110 $PY benchmarks/zero_memory.py throughput >"$OUT/zero.log" 2>&1
  $GPU timeout 110 $PY benchmarks/resnet_throughput.py >"$OUT/resnet.log" 2>&1
elif [ "$PART" = g ]; then  # make test-gpu; the largest GPT at 8 x 1024 with ZeRO 3 + offload (Gemini)
  $GPU timeout 120 $PY -m pytest -q -p no:cacheprovider tests/gpu >"$OUT/test_gpu.log" 2>&1
  $GPU timeout 420 $PY benchmarks/zero_memory.py largest --mode gemini --sizes 6.7B,8B --probe-timeout 200 >"$OUT/largest_gemini.log" 2>&1
elif [ "$PART" = i ]; then  # GPU only: MoE eager at two batches and its profile; plain's largest GPT
  $GPU timeout 60 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_moe.py >"$OUT/test_moe.log" 2>&1
  {
    $GPU timeout 70 $PY benchmarks/moe_throughput.py --device cuda --rounds 3
    $GPU timeout 70 $PY benchmarks/moe_throughput.py --device cuda --rounds 3 --batch 512 --dispatch grouped
  } >"$OUT/moe.log" 2>&1
  $GPU timeout 50 $PY scripts/profile_moe.py >"$OUT/moe_profile.log" 2>&1
  $GPU timeout 200 $PY benchmarks/zero_memory.py largest --mode plain --sizes 4B,6.7B --probe-timeout 100 >"$OUT/largest_plain.log" 2>&1
elif [ "$PART" = h ]; then  # GPU only: MoE at two batches, eager and compiled, profiles; ResNet at 512
  $GPU timeout 60 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_moe.py >"$OUT/test_moe.log" 2>&1
  {
    $GPU timeout 70 $PY benchmarks/moe_throughput.py --device cuda --rounds 3
    $GPU timeout 70 $PY benchmarks/moe_throughput.py --device cuda --rounds 3 --batch 512 --dispatch grouped
    $GPU timeout 130 $PY benchmarks/moe_throughput.py --device cuda --rounds 3 --compile --dispatch grouped
  } >"$OUT/moe.log" 2>&1
  $GPU timeout 50 $PY scripts/profile_moe.py >"$OUT/moe_profile.log" 2>&1
  $GPU timeout 100 $PY scripts/profile_moe.py --compile >"$OUT/moe_profile_compiled.log" 2>&1
  $GPU timeout 100 $PY benchmarks/resnet_throughput.py --batch 512 --steps 30 --repeats 5 >"$OUT/resnet.log" 2>&1
elif [ "$PART" = j ]; then  # GPU only: GPT-2 350M, where its step goes, and the engine's speed levers
  $GPU timeout 200 $PY scripts/profile_step.py --preset medium --extra fast >"$OUT/profile_350m.log" 2>&1
  $GPU timeout 380 $PY benchmarks/gpt_throughput.py --presets medium --compile --fast --rounds 2 \
    --try fast+cdt,fast+fp8mlp >"$OUT/gpt_350m.log" 2>&1
elif [ "$PART" = k ]; then  # GPU only: GPT-2 350M under the compile levers (autotune is slow to build)
  $GPU timeout 560 $PY benchmarks/gpt_throughput.py --presets medium --compile --fast --rounds 2 \
    --try fast+cdt,fast+cdtgraphs,fast+autotune >"$OUT/gpt_350m_k.log" 2>&1
elif [ "$PART" = l ]; then  # GPU only: GPT-2 350M profiled, plain against the tuned compile options
  $GPU timeout 470 $PY scripts/profile_step.py --preset medium --extra fast+cdt,fast+tuned >"$OUT/profile_350m_l.log" 2>&1
elif [ "$PART" = d ]; then  # ResNet ZeRO rows on the host CPU; MoE at size, fp8 parity, ZeRO profile
  mkdir -p /tmp/bin && ln -sf "$(command -v $PY)" /tmp/bin/python
  printf '#!/bin/sh\nexec %s -m gridtrain.cli "$@"\n' "$PY" >/tmp/bin/gridtrain && chmod +x /tmp/bin/gridtrain
  for row in zero1 zero2 zero3 gemini; do
    CUDA_VISIBLE_DEVICES= ROWS=$row BIN=/tmp/bin $CPUS timeout 500 bash demos/resnet/measure_cpu.sh >"$OUT/resnet_$row.log" 2>&1 &
  done
  {
    $GPU timeout 150 $PY benchmarks/moe_throughput.py --device cuda --hidden 512 --rounds 2
    $GPU timeout 120 $PY scripts/profile_step.py --preset small --extra fast+zero2
  } >"$OUT/moe_zero.log" 2>&1
  $GPU timeout 220 $PY benchmarks/fp8_parity.py --plot "$OUT/fp8_parity.png" >"$OUT/fp8.log" 2>&1
  wait
else  # MoE, schedule overhead, largest batch, ZeRO, ResNet
  {
    $GPU timeout 90 $PY benchmarks/moe_throughput.py --device cuda
    $GPU timeout 60 $PY benchmarks/pipeline_bubble.py --single --microbatches 8 32 --chunks 1 2 4 --dim 1024 --mb 256 --reps 2 --rounds 50
    $GPU timeout 100 $PY benchmarks/largest_batch.py
  } >"$OUT/moe_pipe_batch.log" 2>&1
  {
    $GPU timeout 100 $PY benchmarks/zero_memory.py throughput
    $GPU timeout 80 $PY benchmarks/zero_memory.py largest --mode gemini --sizes 1.3B --probe-timeout 75
    $GPU timeout 60 $PY benchmarks/resnet_throughput.py --steps 20 --repeats 3
  } >"$OUT/zero_resnet.log" 2>&1
  wait
fi
ls -la "$OUT"
