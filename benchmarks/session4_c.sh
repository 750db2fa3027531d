#!/usr/bin/env bash
# Session 4, run C (one H200): loopback/graph GPU tests and the loopback sweep (local rows fused over
# fast emulated links, overlapped over slow ones). Repo root, PYTHONPATH=/tmp/site:$PWD.
#   OUT=<dir> bash benchmarks/session4_c.sh
set -u
out=${OUT:-/tmp/mok-s4c}; mkdir -p "$out"
timeout 90 python -m pytest -q -x tests/test_gpu.py -k "loopback or captures or deterministic" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"
timeout ${T_LB:-200} python -m mok_megatron.bench.overlap overlap --shapes dsv3-4k,qwen3-ep8 --gbps 0,450,50 \
  --chunks 1,2,4 --modes exact,sync-free+graph --iters 10 --warmup 3 --json "$out/overlap.json" > "$out/overlap.txt" 2>&1
echo "== bench overlap rc=$?"; grep -E "^\||^profile|fail|Error" "$out/overlap.txt" | cut -c1-200
