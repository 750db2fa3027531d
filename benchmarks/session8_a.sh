#!/usr/bin/env bash
# Session 8, run A (one H200, no TE): the FP8 permute / combine fused into the native FP8 experts' operands
# at EP=1 (fp8.token_experts). GPU tests (bitwise fused vs unfused layer, no host sync, the new kernels at
# real sizes), the limits probe with the unfused path as A/B in the same run (fused before and after it),
# kernel profiles (fused / unfused), one CUDA graph, `mok bench layer`.  Repo root, PYTHONPATH=/tmp/site:$PWD.
#   OUT=<dir> bash benchmarks/session8_a.sh [tests] [limits] [profile] [graph] [bench]   (default: all)
set -u
out=${OUT:-/tmp/mok-s8a}; mkdir -p "$out"
steps=${*:-tests limits profile graph bench}
for step in $steps; do case $step in
tests)
  timeout 240 python -m pytest -q tests/test_fp8_gpu.py tests/test_fp8_quant_kernels.py tests/test_layer_launches.py \
    -m gpu -k "not te_" > "$out/gpu_tests.txt" 2>&1
  echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^ERROR|^E  " "$out/gpu_tests.txt" | head -12 ;;
limits)
  timeout 300 python benchmarks/layer_limits_probe.py deepseek-v3-ep32 qwen3-30b-a3b > "$out/limits.txt" 2>&1
  echo "== limits rc=$?"; grep -E "^==|layer|gemms|timeline|GPU while|\[" "$out/limits.txt" | cut -c1-170 | head -70 ;;
profile)
  timeout 150 python benchmarks/fp8_host_profile.py --shapes deepseek-v3-ep32,qwen3-30b-a3b \
    --backends torch-fp8,torch-fp8-unfused > "$out/profile.txt" 2>&1
  echo "== profile rc=$?"; grep -E "^==|ms x" "$out/profile.txt" | cut -c1-150 | head -64 ;;
graph)
  MOK_EXPERT_BACKEND=torch-fp8 timeout 120 python benchmarks/layer_graph.py deepseek-v3-ep32 qwen3-30b-a3b \
    > "$out/graph_torch-fp8.txt" 2>&1
  echo "== graph rc=$?"; grep -v -i warn "$out/graph_torch-fp8.txt" | tail -8 ;;
bench)
  timeout 200 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --impl mok,mok-torch-fp8 \
    --iters 20 --json "$out/layer-uniform.json" > "$out/layer.txt" 2>&1
  echo "== bench layer rc=$?"; grep -E "^\| " "$out/layer.txt" | grep -v "^| impl\|^|---" | cut -c1-200 ;;
*) echo "unknown step $step"; exit 2 ;;
esac; done
