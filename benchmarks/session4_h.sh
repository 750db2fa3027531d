#!/usr/bin/env bash
# Session 4, run H (one H200, TE installed): mok bench layer on the shapes and routings not yet measured
# (Qwen3-235B-A22B EP=32 slice, Mixtral-8x7B; zipf and one-hot routing). Repo root, PYTHONPATH=/tmp/site:$PWD.
set -u
out=${OUT:-/tmp/mok-s4h}; mkdir -p "$out"
export PYTHONWARNINGS=ignore
timeout ${T1:-150} python -m mok_megatron.cli bench layer --shape qwen3-235b-a22b-ep32,mixtral-8x7b \
  --routing uniform,zipf,one-hot --iters 10 --warmup 3 --impl mok,megatron-te,megatron,plain-pytorch \
  --json "$out/layer-new-shapes.json" --png "$out/layer-new-shapes.png" > "$out/layer-new-shapes.txt" 2>&1
echo "== new shapes rc=$?"; grep -E "^(###|\| (mok|megatron|plain))" "$out/layer-new-shapes.txt" | cut -c1-160
timeout ${T2:-110} python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 \
  --routing zipf,one-hot --iters 10 --warmup 3 --impl mok,megatron-te,plain-pytorch \
  --json "$out/layer-skewed.json" --png "$out/layer-skewed.png" > "$out/layer-skewed.txt" 2>&1
echo "== skewed rc=$?"; grep -E "^(###|\| (mok|megatron|plain))" "$out/layer-skewed.txt" | cut -c1-160
