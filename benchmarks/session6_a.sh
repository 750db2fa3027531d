#!/usr/bin/env bash
# Session 6, run A (one H200, no TE): why the FP8 wgrad quantization runs at ~2 TB/s (probe of variants),
# the GPU tests of the session-5/6 code (FP8 pipeline expert calls, router GEMM, EP=1 plan on the routing
# kernels for bf16 too), kernel profile and `mok bench layer` (MoK bf16 / torch-fp8, with the new
# back-to-back column).  Repo root, PYTHONPATH=/tmp/site:$PWD.
#   OUT=<dir> bash benchmarks/session6_a.sh [probe] [tests] [profile] [bench]   (default: all four)
set -u
out=${OUT:-/tmp/mok-s6a}; mkdir -p "$out"
steps=${*:-probe tests profile bench}
for step in $steps; do case $step in
probe)
  timeout 170 python benchmarks/fp8_seg_probe2.py > "$out/seg_probe2.txt" 2>&1
  echo "== seg probe rc=$?"; grep -v -i warn "$out/seg_probe2.txt" | tail -60 ;;
tests)
  timeout 200 python -m pytest -q tests/test_fp8_gpu.py tests/test_layer_launches.py tests/test_router_gemm.py \
    tests/test_gpu.py -k "not te_ and not demo and not ep2 and not combined_1f1b and not dist_checkpoint" \
    > "$out/gpu_tests.txt" 2>&1
  echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^ERROR|^E  " "$out/gpu_tests.txt" | head -12 ;;
profile)
  timeout 100 python benchmarks/fp8_host_profile.py > "$out/profile.txt" 2>&1
  echo "== profile rc=$?"; grep -E "^==|ms x" "$out/profile.txt" | cut -c1-150 | head -64 ;;
bench)
  timeout 150 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --impl mok,mok-torch-fp8 \
    --iters 20 --json "$out/layer-uniform.json" > "$out/layer.txt" 2>&1
  echo "== bench layer rc=$?"; grep -E "^\| (mok|megatron)" "$out/layer.txt" ;;
*) echo "unknown step $step"; exit 2 ;;
esac; done
