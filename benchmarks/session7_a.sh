#!/usr/bin/env bash
# Session 7, run A (one H200, TE 2.20.2): `mok bench layer` with every peer and the FP8 rows, both shapes,
# same run, now with the "expert GEMMs alone" floor row and the GPU clock / power / slowdown reasons per row.
#   Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session7_a.sh
set -u
out=${OUT:-/tmp/mok-s7a}; mkdir -p "$out"
nvidia-smi -q -d POWER,CLOCK > "$out/nvidia_smi.txt" 2>&1
timeout 420 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 \
  --impl mok,megatron,megatron-te,torchtitan,plain-pytorch,mok-torch-fp8,mok-te-blockwise --iters 20 \
  --json "$out/layer-uniform.json" --png "$out/layer-uniform.png" > "$out/layer.txt" 2>&1
echo "== bench layer rc=$?"; grep -E "^\| |skipped|^- " "$out/layer.txt" | grep -v "^| impl\|^|---" | cut -c1-200
