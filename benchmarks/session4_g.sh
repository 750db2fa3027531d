#!/usr/bin/env bash
# Session 4, run G (one H200): FP8 dispatch on the loopback stand-in (sync-free + CUDA graph, bf16 vs FP8
# dispatch rows), plus the pipeline GPU tests. Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash ...
set -u
out=${OUT:-/tmp/mok-s4g}; mkdir -p "$out"
timeout 60 python -m pytest -q -x tests/test_gpu.py -k "loopback or captures" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"
timeout ${T_LB:-150} python -m mok_megatron.bench.overlap overlap --shapes dsv3-4k,qwen3-ep8 --gbps 0,450,50 \
  --chunks 1,2 --modes sync-free+graph,sync-free+graph+fp8 --iters 8 --warmup 3 \
  --json "$out/overlap.json" > "$out/overlap.txt" 2>&1
echo "== bench overlap rc=$?"; grep -E "^\||fail|Error" "$out/overlap.txt" | cut -c1-200
