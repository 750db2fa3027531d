#!/usr/bin/env bash
# Session 8, run D (one H200, no TE): the overlap pipeline's native FP8 expert calls with the permute /
# combine fused into their operands. GPU tests (FP8 backends, pipeline on the loopback transport, CUDA graph
# capture), then fused vs unfused vs fused in one process (benchmarks/fp8_pipeline_ab.py, loopback EP=32 on
# the DeepSeek slice).  Repo root, PYTHONPATH=/tmp/site:$PWD.   OUT=<dir> bash benchmarks/session8_d.sh
set -u
out=${OUT:-/tmp/mok-s8d}; mkdir -p "$out"
timeout 240 python -m pytest -q tests/test_fp8_gpu.py tests/test_gpu.py -m gpu \
  -k "not te_ and not demo and not ep2 and not combined_1f1b and not dist_checkpoint" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^ERROR|^E  " "$out/gpu_tests.txt" | head -12
timeout 240 python benchmarks/fp8_pipeline_ab.py --shapes dsv3-4k --gbps 0,450 --modes sync-free+graph,exact \
  > "$out/ab.txt" 2>&1
echo "== A/B rc=$?"; grep -E "^==|^\||Error" "$out/ab.txt" | grep -v "^|---\|^| shape" | cut -c1-160
