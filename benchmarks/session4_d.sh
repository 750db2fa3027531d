#!/usr/bin/env bash
# Session 4, run D (one H200): loopback sweep after the backward reorder, local rows overlapped vs
# fused per emulated link. Repo root, PYTHONPATH=/tmp/site:$PWD.   OUT=<dir> bash benchmarks/session4_d.sh
set -u
out=${OUT:-/tmp/mok-s4d}; mkdir -p "$out"
timeout ${T_LB:-220} python -m mok_megatron.bench.overlap overlap --shapes dsv3-4k,qwen3-ep8 --gbps 450,50 \
  --chunks 1,2,4 --modes exact,sync-free+graph --local-rows overlap,fused --iters 8 --warmup 3 \
  --json "$out/overlap.json" > "$out/overlap.txt" 2>&1
echo "== bench overlap rc=$?"; grep -E "^\||^profile|fail|Error" "$out/overlap.txt" | cut -c1-200
