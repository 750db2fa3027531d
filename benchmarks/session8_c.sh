#!/usr/bin/env bash
# Session 8, run C (one H200, no TE): the loopback transport standing in for EP=32 on the DeepSeek-V3 slice
# (`mok bench overlap`), sync-free + CUDA graph, bf16 rows vs FP8 dispatch vs FP8 dispatch + combine
# (--mok-fp8-combine, new), with bf16 and native FP8 experts, at an infinite, 450 and 50 GB/s link.
#   Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session8_c.sh
set -u
out=${OUT:-/tmp/mok-s8c}; mkdir -p "$out"
for backend in torch torch-fp8; do
  timeout ${T_LB:-200} python -m mok_megatron.bench.overlap overlap --shapes dsv3-4k --gbps 0,450,50 --chunks 1 \
    --modes sync-free+graph,sync-free+graph+fp8,sync-free+graph+fp8-both --expert-backend $backend \
    --iters 10 --warmup 3 --json "$out/overlap-$backend.json" > "$out/overlap-$backend.txt" 2>&1
  echo "== bench overlap ($backend experts) rc=$?"; grep -E "^\||fail|Error" "$out/overlap-$backend.txt" | cut -c1-200
done
